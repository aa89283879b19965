/*
 * record_layout: prints sizeof/offsetof of every MSPTI and CUPTI activity
 * record of the stand-in headers as JSON, for the Rust layout test:
 *   {"msptiActivityKernel": {"size": 56, "kind": 0, ...}, ...}
 */
#include <stddef.h>
#include <stdio.h>

#include "standin_cupti.h"
#include "standin_mspti.h"

static int first_struct = 1;

static void begin(const char *name, size_t size)
{
    printf("%s\"%s\": {\"size\": %zu", first_struct ? "{" : ", ", name, size);
    first_struct = 0;
}

static void field(const char *name, size_t offset)
{
    printf(", \"%s\": %zu", name, offset);
}

static void end(void)
{
    printf("}");
}

#define BEGIN(T) begin(#T, sizeof(T))
#define FIELD(T, f, label) field(label, offsetof(T, f))

int main(void)
{
    BEGIN(msptiActivityKernel);
    FIELD(msptiActivityKernel, kind, "kind");
    FIELD(msptiActivityKernel, start, "start");
    FIELD(msptiActivityKernel, end, "end");
    FIELD(msptiActivityKernel, ds.deviceId, "deviceId");
    FIELD(msptiActivityKernel, ds.streamId, "streamId");
    FIELD(msptiActivityKernel, correlationId, "correlationId");
    FIELD(msptiActivityKernel, type, "type");
    FIELD(msptiActivityKernel, name, "name");
    end();

    BEGIN(msptiActivityHccl);
    FIELD(msptiActivityHccl, kind, "kind");
    FIELD(msptiActivityHccl, start, "start");
    FIELD(msptiActivityHccl, end, "end");
    FIELD(msptiActivityHccl, ds.deviceId, "deviceId");
    FIELD(msptiActivityHccl, ds.streamId, "streamId");
    FIELD(msptiActivityHccl, bandWidth, "bandWidth");
    FIELD(msptiActivityHccl, name, "name");
    FIELD(msptiActivityHccl, commName, "commName");
    end();

    BEGIN(msptiActivityCommunication);
    FIELD(msptiActivityCommunication, kind, "kind");
    FIELD(msptiActivityCommunication, dataType, "dataType");
    FIELD(msptiActivityCommunication, count, "count");
    FIELD(msptiActivityCommunication, ds.deviceId, "deviceId");
    FIELD(msptiActivityCommunication, ds.streamId, "streamId");
    FIELD(msptiActivityCommunication, start, "start");
    FIELD(msptiActivityCommunication, end, "end");
    FIELD(msptiActivityCommunication, algType, "algType");
    FIELD(msptiActivityCommunication, name, "name");
    FIELD(msptiActivityCommunication, commName, "commName");
    FIELD(msptiActivityCommunication, correlationId, "correlationId");
    end();

    BEGIN(msptiActivityMarker);
    FIELD(msptiActivityMarker, kind, "kind");
    FIELD(msptiActivityMarker, flag, "flag");
    FIELD(msptiActivityMarker, sourceKind, "sourceKind");
    FIELD(msptiActivityMarker, timestamp, "timestamp");
    FIELD(msptiActivityMarker, id, "id");
    FIELD(msptiActivityMarker, objectId, "objectId");
    FIELD(msptiActivityMarker, name, "name");
    FIELD(msptiActivityMarker, domain, "domain");
    end();

    BEGIN(msptiActivityApi);
    FIELD(msptiActivityApi, kind, "kind");
    FIELD(msptiActivityApi, start, "start");
    FIELD(msptiActivityApi, end, "end");
    FIELD(msptiActivityApi, pt.processId, "processId");
    FIELD(msptiActivityApi, pt.threadId, "threadId");
    FIELD(msptiActivityApi, correlationId, "correlationId");
    FIELD(msptiActivityApi, name, "name");
    end();

    BEGIN(CUpti_ActivityKernel9);
    FIELD(CUpti_ActivityKernel9, kind, "kind");
    FIELD(CUpti_ActivityKernel9, start, "start");
    FIELD(CUpti_ActivityKernel9, end, "end");
    FIELD(CUpti_ActivityKernel9, completed, "completed");
    FIELD(CUpti_ActivityKernel9, deviceId, "deviceId");
    FIELD(CUpti_ActivityKernel9, contextId, "contextId");
    FIELD(CUpti_ActivityKernel9, streamId, "streamId");
    FIELD(CUpti_ActivityKernel9, gridX, "gridX");
    FIELD(CUpti_ActivityKernel9, blockX, "blockX");
    FIELD(CUpti_ActivityKernel9, dynamicSharedMemory, "dynamicSharedMemory");
    FIELD(CUpti_ActivityKernel9, correlationId, "correlationId");
    FIELD(CUpti_ActivityKernel9, gridId, "gridId");
    FIELD(CUpti_ActivityKernel9, name, "name");
    FIELD(CUpti_ActivityKernel9, queued, "queued");
    FIELD(CUpti_ActivityKernel9, submitted, "submitted");
    FIELD(CUpti_ActivityKernel9, graphNodeId, "graphNodeId");
    FIELD(CUpti_ActivityKernel9, channelType, "channelType");
    FIELD(CUpti_ActivityKernel9, maxActiveClusters, "maxActiveClusters");
    end();

    BEGIN(CUpti_ActivityMemcpy6);
    FIELD(CUpti_ActivityMemcpy6, kind, "kind");
    FIELD(CUpti_ActivityMemcpy6, copyKind, "copyKind");
    FIELD(CUpti_ActivityMemcpy6, bytes, "bytes");
    FIELD(CUpti_ActivityMemcpy6, start, "start");
    FIELD(CUpti_ActivityMemcpy6, end, "end");
    FIELD(CUpti_ActivityMemcpy6, deviceId, "deviceId");
    FIELD(CUpti_ActivityMemcpy6, streamId, "streamId");
    FIELD(CUpti_ActivityMemcpy6, correlationId, "correlationId");
    FIELD(CUpti_ActivityMemcpy6, copyCount, "copyCount");
    end();

    BEGIN(CUpti_ActivityAPI);
    FIELD(CUpti_ActivityAPI, kind, "kind");
    FIELD(CUpti_ActivityAPI, cbid, "cbid");
    FIELD(CUpti_ActivityAPI, start, "start");
    FIELD(CUpti_ActivityAPI, end, "end");
    FIELD(CUpti_ActivityAPI, processId, "processId");
    FIELD(CUpti_ActivityAPI, threadId, "threadId");
    FIELD(CUpti_ActivityAPI, correlationId, "correlationId");
    FIELD(CUpti_ActivityAPI, returnValue, "returnValue");
    end();

    printf("}\n");
    return 0;
}

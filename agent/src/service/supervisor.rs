//! `agent service`: loads the kernel programs, starts the pipeline with
//! the flight recorder and the metrics sinks, the kernel side (collect,
//! discovery, device probes, runtime levels: [`super::kernel_side`]), the
//! metrics endpoint and the control API, tells systemd it is ready, pings
//! the watchdog while the pipeline is alive (the metrics sink heard from
//! it within its liveness bound: a stuck pipeline stops the pings and
//! systemd restarts the agent), reloads on SIGHUP, and stops on
//! SIGTERM/SIGINT: the kernel side detaches and drains first, then every
//! sink is finished.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use serde_json::{Value, json};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};

use super::config::{CaptureLevel, LIVE_KEYS, ServiceConfig};
use super::control::{self, Control, PeerPolicy};
use super::kernel_side::{self, KernelHandle, KernelLevels};
use super::notify::Notifier;
#[cfg(test)]
use super::seam::KernelNotAttached;
use super::seam::{JobEnv, LevelSwitch, Running};
use crate::host;
use crate::pipeline::enrich::{LiveEnricher, identities_from_proc};
use crate::pipeline::{PIPELINE_BATCHES, Pipeline, PipelineMsg};
use crate::sinks::detect::{DetectConfig, DetectSink};
use crate::sinks::flight_recorder::{
    DumpError, DumpRequest, DumpSpec, FlightRecorder, RecorderSettings, RecorderStats, Trigger,
};
use crate::sinks::metrics::MetricsSink;
use crate::sinks::{FanOut, SinkCounters};

/// Sink queue depth in batches (as `agent attach`).
const SINK_BATCHES: usize = 64;
const STATUS_EVERY: u32 = 10;

/// The service as the control API sees it.
struct ServiceControl {
    config_path: PathBuf,
    /// The configuration in effect: the one started with, with the keys
    /// reloads applied. Reloads compare the file against this, not against
    /// the last file read, so a key waiting for a restart is reported at
    /// every reload until the service restarts.
    running: Mutex<ServiceConfig>,
    /// The keys the last reload found waiting for a restart.
    restart_needed_for: Mutex<Vec<&'static str>>,
    level: Mutex<CaptureLevel>,
    job_env: JobEnv,
    levels: Arc<dyn LevelSwitch>,
    recorder: Sender<DumpRequest>,
    stats: Arc<RecorderStats>,
    sinks: Vec<(&'static str, Arc<SinkCounters>)>,
    traced: Arc<Mutex<BTreeMap<u32, Value>>>,
    started: Instant,
    /// What the kernel side lost, and its probes' counters.
    losses: Arc<crate::sinks::metrics::KernelLosses>,
    probe_stats: Arc<Mutex<crate::kernel::probes::DeviceProbeStats>>,
    /// The interpret stage's counters, as of the last sink tick.
    interpret: Arc<Mutex<crate::pipeline::interpret::InterpretCounters>>,
}

impl ServiceControl {
    fn current_level(&self) -> CaptureLevel {
        self.level.lock().map(|l| *l).unwrap_or_default()
    }
}

impl Control for ServiceControl {
    fn status(&self) -> Value {
        let s = &self.stats;
        let dumps: serde_json::Map<String, Value> = Trigger::ALL
            .iter()
            .map(|t| {
                let c = s.trigger(*t);
                (
                    t.as_str().to_string(),
                    json!({
                        "written": c.written.load(Ordering::Relaxed),
                        "truncated": c.truncated.load(Ordering::Relaxed),
                        "failed": c.failed.load(Ordering::Relaxed),
                        "rate_limited": c.rate_limited.load(Ordering::Relaxed),
                    }),
                )
            })
            .collect();
        let last = s.last_dump.lock().ok().and_then(|d| d.clone());
        let probes = self.probe_stats.lock().map(|p| *p).unwrap_or_default();
        json!({
            "level": self.current_level().get(),
            "uptime_seconds": self.started.elapsed().as_secs(),
            "processes": self.traced.lock().map(|t| t.len()).unwrap_or(0),
            "restart_needed_for": self
                .restart_needed_for
                .lock()
                .map(|r| r.clone())
                .unwrap_or_default(),
            "flight_recorder": {
                "bytes": s.bytes.load(Ordering::Relaxed),
                "records": s.records.load(Ordering::Relaxed),
                "evicted_records": s.evicted_records.load(Ordering::Relaxed),
                "expired_records": s.expired_records.load(Ordering::Relaxed),
                "dumps": dumps,
                "last_dump": last,
            },
            "memory": {
                "resident": super::heap::resident(),
                "allocator": super::heap::allocator(),
            },
            "kernel": {
                "dropped_events": self.losses.dropped_events.load(Ordering::Relaxed),
                "skipped_events": self.losses.skipped_events.load(Ordering::Relaxed),
                "decode_errors": self.losses.decode_errors.load(Ordering::Relaxed),
            },
            "interpret": self.interpret.lock().map(|c| json!(*c)).unwrap_or_default(),
            "device_probes": {
                "attached": probes.attached,
                "attach_failures": probes.attach_failures,
                "slow_attaches": probes.slow_attaches,
                "slots_in_use": probes.slots_in_use,
                "files_released": probes.files_released,
            },
            "sinks": self.sinks.iter().map(|(name, c)| json!({
                "name": name,
                "delivered_records": c.delivered_records.load(Ordering::Relaxed),
                "dropped_records": c.dropped(),
            })).collect::<Vec<_>>(),
        })
    }

    fn processes(&self) -> Value {
        let traced = self.traced.lock().map(|t| t.clone()).unwrap_or_default();
        Value::Array(traced.into_values().collect())
    }

    fn set_level(&self, level: CaptureLevel) -> Result<Value, String> {
        self.levels.set_level(level)?;
        if let Ok(mut l) = self.level.lock() {
            *l = level;
        }
        Ok(json!({ "level": level.get() }))
    }

    fn dump(&self, spec: DumpSpec, wait: bool) -> Result<Value, DumpError> {
        control::request_dump(&self.recorder, spec, wait)
    }

    fn reload(&self) -> Result<Value, String> {
        let result = self.apply_file();
        match &result {
            Ok(v) => {
                tracing::info!("configuration reloaded: {v}");
                let restart = &v["restart_needed_for"];
                if restart.as_array().is_some_and(|r| !r.is_empty()) {
                    tracing::warn!(
                        "{}: these keys differ from the running configuration and take effect \
                         only at the next restart: {restart}",
                        self.config_path.display()
                    );
                }
            }
            Err(e) => tracing::error!("reload refused, the running configuration stays: {e}"),
        }
        result
    }
}

impl ServiceControl {
    /// Reads the file and applies what differs from the running
    /// configuration and can change live ([`LIVE_KEYS`]); the rest is
    /// reported. A level the kernel side refuses fails the whole reload,
    /// before anything else changed.
    fn apply_file(&self) -> Result<Value, String> {
        let new = ServiceConfig::load(&self.config_path).map_err(|e| e.to_string())?;
        let mut running = self
            .running
            .lock()
            .map_err(|_| "a previous reload panicked; restart the service".to_string())?;
        // The level in effect may come from `agent ctl level`: a reload
        // brings it back to the file's.
        let mut effective = running.clone();
        effective.level = self.current_level();
        let changed = effective.changed_keys(&new);
        let mut applied = Vec::new();
        if changed.contains(&"level") {
            self.set_level(new.level)
                .map_err(|e| format!("level {}: {e}", new.level))?;
            running.level = new.level;
            applied.push("level");
        }
        if changed.contains(&"labels.job_env") {
            self.job_env.set(&new.labels.job_env);
            running.labels = new.labels.clone();
            applied.push("labels.job_env");
        }
        debug_assert!(applied.iter().all(|k| LIVE_KEYS.contains(k)));
        let restart: Vec<&'static str> = changed
            .into_iter()
            .filter(|k| !LIVE_KEYS.contains(k))
            .collect();
        if let Ok(mut r) = self.restart_needed_for.lock() {
            *r = restart.clone();
        }
        Ok(json!({
            "reloaded": self.config_path,
            "level": self.current_level().get(),
            "applied": applied,
            "restart_needed_for": restart,
        }))
    }
}

/// `agent service` until SIGTERM or SIGINT.
pub fn run(config_path: PathBuf, cfg: ServiceConfig) -> Result<()> {
    // The service runs for months and idles between jobs: freed pages go
    // back to the system then too.
    if let Err(e) = super::heap::purge_in_background() {
        tracing::warn!(
            "the allocator's background purging could not start ({e}): freed memory returns only while the agent allocates"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("xpuscope-io")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sighup = signal(SignalKind::hangup())?;
        let kernel = kernel_side::load(&cfg)?;
        let (levels, level_requests) = KernelLevels::channel();
        let (reload_tx, reload_rx) = mpsc::channel(4);
        let stop = async move {
            loop {
                tokio::select! {
                    _ = sigterm.recv() => return,
                    _ = sigint.recv() => return,
                    _ = sighup.recv() => { let _ = reload_tx.send(()).await; }
                }
            }
        };
        let kernel_cfg = cfg.clone();
        serve(
            config_path,
            cfg,
            Arc::new(levels),
            stop,
            reload_rx,
            |running| async move {
                kernel_side::start(kernel, &kernel_cfg, running, level_requests)
                    .await
                    .map(Some)
            },
        )
        .await
    })
}

/// The service until `stop` completes; `reload` asks for a configuration
/// reload (SIGHUP); `started` gets what the kernel side plugs into and
/// starts it (its handle, stopped before the sinks finish), before the
/// service says it is ready.
pub async fn serve<K>(
    config_path: PathBuf,
    cfg: ServiceConfig,
    levels: Arc<dyn LevelSwitch>,
    stop: impl Future<Output = ()>,
    mut reload: mpsc::Receiver<()>,
    started: impl FnOnce(Running) -> K,
) -> Result<()>
where
    K: Future<Output = Result<Option<KernelHandle>>>,
{
    let notifier = Notifier::from_env();
    super::dump_dir::prepare(&cfg.dump_dir).map_err(|e| anyhow!(e))?;
    let node = host::node_name();
    let (recorder, dump_tx, stats) = FlightRecorder::new(RecorderSettings {
        window: cfg.flight_recorder.seconds,
        max_bytes: cfg.flight_recorder.max_bytes,
        dump_dir: cfg.dump_dir.clone(),
        dump_dir_max_bytes: cfg.dump_dir_max_bytes,
        max_dumps_per_hour: cfg.max_dumps_per_hour,
        host: node.clone(),
        write_limit: None,
        dump_on_finding: cfg.detect.dump_on_finding,
    });
    let (metrics, metrics_handle, sources) = MetricsSink::new(&node);
    let mut fanout = FanOut::default();
    let recorder = fanout.add("flight_recorder", recorder, SINK_BATCHES)?;
    let metrics = fanout.add("metrics", metrics, SINK_BATCHES)?;
    // Findings go back into the stream: the recorder dumps on them,
    // metrics count them.
    let (findings_tx, findings_rx) = std::sync::mpsc::channel();
    let detect = fanout.add(
        "detect",
        DetectSink::new(
            DetectConfig {
                hang_timeout: cfg.detect.hang_timeout,
                host: cfg.detect.host.clone(),
                collective: cfg.detect.collective.clone(),
                gpu: Default::default(),
            },
            Some(findings_tx),
        ),
        SINK_BATCHES,
    )?;
    if let Ok(mut s) = sources.sinks.lock() {
        s.push((recorder.name, recorder.counters.clone()));
        s.push((detect.name, detect.counters.clone()));
    }
    if let Ok(mut r) = sources.recorder.lock() {
        *r = Some(stats.clone());
    }
    let (tx, rx) = mpsc::channel::<PipelineMsg>(PIPELINE_BATCHES);
    let (announce, announce_rx) = std::sync::mpsc::channel();
    let (stack_ends, stack_ends_rx) = std::sync::mpsc::channel();
    let caches = sources.caches.clone();
    let interpret_counters = sources.interpret.clone();
    let job_env = JobEnv::new(&cfg.labels.job_env);
    let pipeline_job_env = job_env.clone();
    // GPU health from the host's NVML (`[gpu_health]`); nothing when the
    // host has none.
    let (health, health_rx) = crate::health::start(&cfg.gpu_health);
    let pipeline = crate::pipeline::start_thread(
        move || {
            let enricher = LiveEnricher::with_caches(caches)
                .with_identities(identities_from_proc(move || pipeline_job_env.get()))
                .with_stack_ends_later(stack_ends_rx);
            let mut pipeline = Pipeline::new(enricher, fanout)
                .with_published_counters(interpret_counters)
                .with_findings(findings_rx)
                .with_health(health_rx)
                .with_announcements(announce_rx);
            pipeline.start(host::boottime_ns(), Vec::new());
            pipeline
        },
        rx,
    )?;

    let (stop_tx, stop_rx) = watch::channel(false);
    if let Some(addr) = cfg.metrics.listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("metrics.listen {addr}"))?;
        tokio::spawn(super::metrics_endpoint::serve(
            listener,
            metrics_handle.clone(),
            stop_rx.clone(),
        ));
    }
    let traced = Arc::new(Mutex::new(BTreeMap::new()));
    let control: Arc<dyn Control> = Arc::new(ServiceControl {
        config_path,
        running: Mutex::new(cfg.clone()),
        restart_needed_for: Mutex::new(Vec::new()),
        level: Mutex::new(cfg.level),
        job_env: job_env.clone(),
        levels,
        recorder: dump_tx,
        stats: stats.clone(),
        sinks: vec![
            (recorder.name, recorder.counters.clone()),
            (metrics.name, metrics.counters.clone()),
            (detect.name, detect.counters.clone()),
        ],
        traced: traced.clone(),
        started: Instant::now(),
        losses: sources.kernel_losses.clone(),
        probe_stats: sources.probe_stats.clone(),
        interpret: sources.interpret.clone(),
    });
    let group = cfg
        .control
        .group
        .as_deref()
        .map(control::group_id)
        .transpose()
        .map_err(|e| anyhow!(e))?;
    let (listener, socket_file) = control::bind_socket(&cfg.control.socket, group)
        .map_err(|e| anyhow!("control.socket: {e}"))?;
    let policy = PeerPolicy {
        // SAFETY: geteuid has no preconditions.
        own_uid: unsafe { libc::geteuid() },
        group,
    };
    tokio::spawn(control::serve_unix(
        listener,
        policy,
        control.clone(),
        stop_rx.clone(),
    ));
    if let (Some(addr), Some(token_file)) = (cfg.control.tcp_listen, &cfg.control.token_file) {
        let token = control::read_token(token_file).map_err(|e| anyhow!(e))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("control.tcp_listen {addr}"))?;
        tokio::spawn(control::serve_tcp(
            listener,
            token,
            control.clone(),
            stop_rx.clone(),
        ));
    }
    let mut kernel = match started(Running {
        pipeline: tx.clone(),
        announce,
        traced: traced.clone(),
        job_env,
        probe_stats: sources.probe_stats.clone(),
        losses: sources.kernel_losses.clone(),
        stack_ends,
    })
    .await
    {
        Ok(k) => k,
        Err(e) => {
            // Still finish the sinks (and remove the socket) on the way out.
            let _ = stop_tx.send(true);
            drop(tx);
            drop(control);
            drop(socket_file);
            let _ = tokio::task::spawn_blocking(move || {
                let _ = pipeline.join();
                let _ = recorder.join();
                let _ = metrics.join();
                let _ = detect.join();
            })
            .await;
            return Err(e.context("starting the kernel side"));
        }
    };
    notifier.send(&format!(
        "READY=1\nSTATUS=level {}, flight recorder {:?}",
        cfg.level, cfg.flight_recorder.seconds
    ));

    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut ticks = 0u32;
    tokio::pin!(stop);
    let failure = loop {
        tokio::select! {
            _ = &mut stop => break None,
            Some(()) = reload.recv() => {
                let c = control.clone();
                // The reload logs its outcome itself (as for `agent ctl reload`).
                if let Err(e) = tokio::task::spawn_blocking(move || c.reload()).await {
                    tracing::error!("reload failed: {e}");
                }
            }
            _ = tick.tick() => {
                ticks += 1;
                if pipeline.is_finished()
                    || recorder.is_finished()
                    || metrics.is_finished()
                    || detect.is_finished()
                {
                    break Some(anyhow!("a pipeline stage stopped"));
                }
                if kernel.as_ref().is_some_and(KernelHandle::is_finished) {
                    break Some(anyhow!("the kernel side stopped"));
                }
                // With a kernel side, collect is the pipeline's clock (its
                // ticks say how far the records are complete); without
                // one (tests of the interfaces) time passes here.
                if kernel.is_none() {
                    let _ = tx.try_send(PipelineMsg::Tick(host::boottime_ns()));
                }
                // The watchdog is fed only while the pipeline feeds the sinks.
                if metrics_handle.alive(host::boottime_ns()) {
                    notifier.send("WATCHDOG=1");
                }
                if ticks.is_multiple_of(STATUS_EVERY) {
                    notifier.send(&format!(
                        "STATUS=level {}, {} processes, flight recorder {} MiB, {} records evicted",
                        control.status()["level"],
                        traced.lock().map(|t| t.len()).unwrap_or(0),
                        stats.bytes.load(Ordering::Relaxed) >> 20,
                        stats.evicted_records.load(Ordering::Relaxed),
                    ));
                }
            }
        }
    };
    notifier.send("STOPPING=1");
    let _ = stop_tx.send(true);
    // Detached and drained before the pipeline's input ends.
    let kernel_result = match kernel.take() {
        Some(k) => k.stop().await,
        None => Ok(()),
    };
    let gpu_health = tokio::task::spawn_blocking(move || health.stop()).await;
    if let Ok(h) = gpu_health {
        tracing::info!("{}", h.gpu.line());
        tracing::info!("{}", h.npu.line());
    }
    drop(tx);
    drop(control);
    drop(socket_file);
    let joined = tokio::task::spawn_blocking(move || {
        let p = pipeline
            .join()
            .map_err(|p| {
                anyhow!(
                    "the pipeline panicked: {}",
                    crate::sinks::panic_message(&*p)
                )
            })
            .and_then(|r| r.map(|_| ()));
        let r = recorder.join().map(|_| ());
        let m = metrics.join();
        let d = detect.join().map(|_| ());
        p.and(r).and(m).and(d)
    })
    .await?;
    match failure {
        Some(e) => {
            let e = match kernel_result {
                Err(k) => k.context(e),
                Ok(()) => e,
            };
            Err(joined
                .err()
                .map_or(e, |j| j.context("a pipeline stage stopped")))
        }
        None => kernel_result.and(joined),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::control::client::request;
    use xpuscope_tests::trace_check::{check_importer_rules, decode};

    #[test]
    fn the_service_serves_its_interfaces_and_dumps_valid_traces() {
        let dir = std::env::temp_dir().join(format!("xpuscope-svc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config_path = dir.join("agent.toml");
        let socket = dir.join("run/agent.sock");
        let text = format!(
            "level = 1\ndump_dir = \"{}\"\n[metrics]\nlisten = \"off\"\n[control]\nsocket = \"{}\"\n",
            dir.join("dumps").display(),
            socket.display()
        );
        std::fs::write(&config_path, &text).unwrap();
        let cfg = ServiceConfig::load(&config_path).unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (_reload_tx, reload_rx) = mpsc::channel(1);
        let path = config_path.clone();
        let service = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(serve(
                path,
                cfg,
                Arc::new(KernelNotAttached),
                async {
                    let _ = stop_rx.await;
                },
                reload_rx,
                |_| async { Ok(None) },
            ))
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            assert!(
                Instant::now() < deadline,
                "the control socket never appeared"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let status = request(&socket, "GET", "/status", None).unwrap();
        assert_eq!(status.status, 200, "{}", status.body);
        let v: Value = serde_json::from_str(&status.body).unwrap();
        assert_eq!(v["level"], 1);

        let r = request(&socket, "POST", "/dump", Some(&json!({}))).unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let out: Value = serde_json::from_str(&r.body).unwrap();
        let trace = std::fs::read(out["trace"].as_str().unwrap()).unwrap();
        check_importer_rules(&decode(&trace).unwrap()).unwrap();

        let r = request(&socket, "POST", "/level", Some(&json!({ "level": 2 }))).unwrap();
        assert_eq!(r.status, 409);
        assert!(r.body.contains("not attached"), "{}", r.body);

        std::fs::write(&config_path, format!("{text}levle = 2\n")).unwrap();
        let r = request(&socket, "POST", "/reload", None).unwrap();
        assert_eq!(r.status, 400);
        assert!(
            r.body.contains("agent.toml:7: unknown key `control.levle`"),
            "{}",
            r.body
        );
        // The old configuration stays.
        let v: Value =
            serde_json::from_str(&request(&socket, "GET", "/status", None).unwrap().body).unwrap();
        assert_eq!(v["level"], 1);

        stop_tx.send(()).unwrap();
        service.join().unwrap().unwrap();
        assert!(!socket.exists(), "the socket goes with the service");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The control side of a service started from `text`, its level
    /// switch answering as `levels` does.
    fn control_of(
        dir: &std::path::Path,
        text: &str,
        levels: Arc<dyn LevelSwitch>,
    ) -> (ServiceControl, PathBuf) {
        std::fs::create_dir_all(dir).unwrap();
        let path = dir.join("agent.toml");
        std::fs::write(&path, text).unwrap();
        let cfg = ServiceConfig::load(&path).unwrap();
        let (recorder, _) = std::sync::mpsc::channel();
        let control = ServiceControl {
            config_path: path.clone(),
            running: Mutex::new(cfg.clone()),
            restart_needed_for: Mutex::new(Vec::new()),
            level: Mutex::new(cfg.level),
            job_env: JobEnv::new(&cfg.labels.job_env),
            levels,
            recorder,
            stats: Arc::new(RecorderStats::default()),
            sinks: Vec::new(),
            traced: Arc::new(Mutex::new(BTreeMap::new())),
            started: Instant::now(),
            losses: Arc::default(),
            probe_stats: Arc::default(),
            interpret: Arc::default(),
        };
        (control, path)
    }

    struct AnyLevel;
    impl LevelSwitch for AnyLevel {
        fn set_level(&self, _level: CaptureLevel) -> Result<(), String> {
            Ok(())
        }
    }

    fn keys(v: &Value, field: &str) -> Vec<String> {
        v[field]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"))
            .iter()
            .map(|k| k.as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn a_reload_applies_live_keys_and_reports_the_others_until_restart() {
        let dir = std::env::temp_dir().join(format!("xpuscope-reload-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let start = "level = 1\n[flight_recorder]\nseconds = 120\n";
        let (c, path) = control_of(&dir, start, Arc::new(AnyLevel));
        let v = c.reload().unwrap();
        assert!(keys(&v, "applied").is_empty() && keys(&v, "restart_needed_for").is_empty());

        std::fs::write(
            &path,
            "level = 2\n[flight_recorder]\nseconds = 30\n[labels]\njob_env = [\"MY_JOB\"]\n\
             [rings]\nscheduler = \"16M\"\n",
        )
        .unwrap();
        let v = c.reload().unwrap();
        assert_eq!(keys(&v, "applied"), ["level", "labels.job_env"]);
        assert_eq!(
            keys(&v, "restart_needed_for"),
            ["flight_recorder.seconds", "rings.scheduler"]
        );
        assert_eq!(v["level"], 2);
        assert_eq!(&*c.job_env.get(), ["MY_JOB".to_string()]);
        // Again, unchanged file: nothing more to apply, the same to restart.
        let v = c.reload().unwrap();
        assert!(keys(&v, "applied").is_empty(), "{v}");
        assert_eq!(
            keys(&v, "restart_needed_for"),
            ["flight_recorder.seconds", "rings.scheduler"]
        );
        assert_eq!(
            c.status()["restart_needed_for"],
            json!(["flight_recorder.seconds", "rings.scheduler"])
        );
        // A level set at runtime goes back to the file's at a reload.
        c.set_level(CaptureLevel::new(3).unwrap()).unwrap();
        let v = c.reload().unwrap();
        assert_eq!(keys(&v, "applied"), ["level"]);
        assert_eq!(v["level"], 2);
        // The file back as started with: nothing waits for a restart.
        std::fs::write(&path, start).unwrap();
        let v = c.reload().unwrap();
        assert_eq!(keys(&v, "applied"), ["level", "labels.job_env"]);
        assert!(keys(&v, "restart_needed_for").is_empty(), "{v}");
        assert_eq!(
            &*c.job_env.get(),
            &crate::model::identity::default_job_env()[..]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_level_the_kernel_refuses_fails_the_reload_and_applies_nothing() {
        let dir = std::env::temp_dir().join(format!("xpuscope-reload-no-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (c, path) = control_of(&dir, "level = 1\n", Arc::new(KernelNotAttached));
        std::fs::write(&path, "level = 2\n[labels]\njob_env = [\"MY_JOB\"]\n").unwrap();
        let e = c.reload().unwrap_err();
        assert!(
            e.starts_with("level 2: ") && e.contains("not attached"),
            "{e}"
        );
        assert_eq!(c.current_level().get(), 1);
        assert_eq!(
            &*c.job_env.get(),
            &crate::model::identity::default_job_env()[..]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

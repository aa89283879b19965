"""World layout of the simulated job: ranks on a TP x DP x PP grid and the
communicators that grid implies.

Rank order follows Megatron-LM's default ("tp-dp-pp"): tensor parallel is the
fastest-varying index, then data parallel, then pipeline stage:

    rank = tp_rank + tp * (dp_rank + dp * pp_stage)

Communicators:
  tp<g>       the TP group of (dp_rank, pp_stage), g = dp_rank + dp * pp_stage
  dp<g>       the DP group of (tp_rank, pp_stage), g = tp_rank + tp * pp_stage
  pp<g>.<s>-<s+1>  the stage pair (s, s+1) of pipeline g = tp_rank + tp * dp_rank,
              comm rank 0 = stage s (sender of activations), 1 = stage s+1
Groups of one rank are not created (no TP comm when tp == 1, ...).

The list is in the order every rank initialises its communicators (all TP,
then all DP, then PP pairs by stage), which keeps the blocking inits free of
deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RankCoord:
    rank: int
    tp_rank: int
    dp_rank: int
    pp_stage: int


@dataclass
class Communicator:
    name: str
    kind: str  # "tp", "dp" or "pp"
    members: list[int]  # global ranks, index = rank inside the communicator

    def comm_rank(self, rank: int) -> int:
        return self.members.index(rank)


@dataclass
class Layout:
    world_size: int
    tp: int
    pp: int
    dp: int
    ranks: list[RankCoord] = field(default_factory=list)
    comms: list[Communicator] = field(default_factory=list)

    def comms_of(self, rank: int) -> list[Communicator]:
        return [c for c in self.comms if rank in c.members]

    def comm(self, name: str) -> Communicator:
        for c in self.comms:
            if c.name == name:
                return c
        raise KeyError(name)

    def dp_comm_of(self, rank: int) -> Communicator | None:
        return next((c for c in self.comms_of(rank) if c.kind == "dp"), None)

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "order": "tp-dp-pp",
            "rank_formula": "rank = tp_rank + tp * (dp_rank + dp * pp_stage)",
        }


def resolve_sizes(world: int | None, tp: int | None, pp: int | None, dp: int | None):
    """Fills in what the user left out. With nothing but the world size, a
    multiple of 4 gets tp=2, pp=2 and the rest DP; other sizes are pure DP."""
    if tp is None and pp is None and dp is None:
        world = 8 if world is None else world
        if world % 4 == 0:
            tp, pp = 2, 2
        else:
            tp, pp = 1, 1
        dp = world // (tp * pp)
    else:
        tp = tp or 1
        pp = pp or 1
        if dp is None:
            if world is None:
                dp = 1
            elif world % (tp * pp):
                raise ValueError(f"world size {world} is not a multiple of tp*pp = {tp * pp}")
            else:
                dp = world // (tp * pp)
        world = tp * pp * dp if world is None else world
    if min(tp, pp, dp, world) < 1:
        raise ValueError("tp, pp, dp and the world size must be at least 1")
    if tp * pp * dp != world:
        raise ValueError(f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} != world size {world}")
    return world, tp, pp, dp


def build_layout(world: int | None, tp: int | None, pp: int | None, dp: int | None) -> Layout:
    world, tp, pp, dp = resolve_sizes(world, tp, pp, dp)
    layout = Layout(world_size=world, tp=tp, pp=pp, dp=dp)

    def rank_of(t: int, d: int, p: int) -> int:
        return t + tp * (d + dp * p)

    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                layout.ranks.append(RankCoord(rank_of(t, d, p), t, d, p))
    layout.ranks.sort(key=lambda c: c.rank)

    if tp > 1:
        for p in range(pp):
            for d in range(dp):
                g = d + dp * p
                members = [rank_of(t, d, p) for t in range(tp)]
                layout.comms.append(Communicator(f"tp{g}", "tp", members))
    if dp > 1:
        for p in range(pp):
            for t in range(tp):
                g = t + tp * p
                members = [rank_of(t, d, p) for d in range(dp)]
                layout.comms.append(Communicator(f"dp{g}", "dp", members))
    if pp > 1:
        for s in range(pp - 1):
            for d in range(dp):
                for t in range(tp):
                    g = t + tp * d
                    members = [rank_of(t, d, s), rank_of(t, d, s + 1)]
                    layout.comms.append(Communicator(f"pp{g}.{s}-{s + 1}", "pp", members))
    return layout


def comm_file_text(layout: Layout, rank: int) -> str:
    """The rank program's comm file: `name kind size comm_rank members...`."""
    lines = ["# name kind size comm_rank members (global ranks in comm-rank order)"]
    for c in layout.comms_of(rank):
        members = " ".join(str(m) for m in c.members)
        lines.append(f"{c.name} {c.kind} {len(c.members)} {c.comm_rank(rank)} {members}")
    return "\n".join(lines) + "\n"


def collectives_per_step(layout: Layout, comm: Communicator, microbatches: int) -> dict:
    """How many operations each member issues on `comm`: at start-up and per
    step (the seq numbering the hang/delay faults and the stand-ins use)."""
    if comm.kind == "dp":
        return {"init": 1, "per_step": 1, "ops": ["broadcast (init)", "all_reduce"]}
    if comm.kind == "tp":
        return {"init": 0, "per_step": 2 * microbatches, "ops": ["all_gather", "reduce_scatter"]}
    return {"init": 0, "per_step": 2 * microbatches, "ops": ["send", "recv"]}

//! Incidents: the findings one fault causes, grouped under it. A rank
//! that hangs makes every peer that waits for it hang too, a rank that
//! stalls makes its pipeline and data-parallel peers arrive late; each
//! detector sees only its own symptom, so a fault comes out as several
//! findings. Here each finding gets the finding it follows from (`cause`)
//! and the incident of the root it leads back to, so a user reads the
//! fault first and its consequences folded under it.
//!
//! What explains what (`explains`), strongest cause first:
//! - a rank that died or whose device failed (`crash`, `device_error`,
//!   `device_oom`) explains a hang that names it as never entering, and its
//!   own crash after it; a leak explains its own rank's `device_oom`;
//! - a hang explains a hang whose missing ranks are all waiting in it (the
//!   wait-for edges between communicators: follow them to the ranks that
//!   wait on nothing collective);
//! - a hang explains a hang without a missing member whose point-to-point
//!   waits (`p2p_waits`: its stuck ranks entered more sends or receives
//!   than their peers matched) all point to ranks missing from it or stuck
//!   in it (follow them to the rank that waits on nothing);
//! - of two hangs missing the same rank, the earlier explains the later
//!   (one incident per culprit), unless the later explains the earlier by
//!   its point-to-point waits (a collective that the rank never entered
//!   says more than a peer's wait for it);
//! - without point-to-point waits (traces of calls without their peers),
//!   a hang that every member entered and none left follows from a hang,
//!   open at the same time, that a rank never entered (its members wait,
//!   through their streams, on point-to-point work with the stuck ranks);
//! - a data-loader stall or host contention explains a late arrival or
//!   slow rank whose lateness overlaps it (contention from up to two of
//!   its steps before its first: its onset trails the neighbour when the
//!   share it takes flickers step by step) (the peers waited for the stalled
//!   rank, then came late themselves), and one neighbour's contention on
//!   several ranks is one incident (the same top preemptor), as is the
//!   contention of ranks whose top preemptors are ranks (more ranks than
//!   CPUs: the job's own doing, every rank alike); an outsider that every
//!   rank of the job suffers alike (a job-level contention) explains each
//!   rank's own contention while it lasts;
//! - a hang explains a late arrival at the operation that hung;
//! - a throttled GPU (`device_throttled`) explains a late arrival or slow
//!   rank while it lasts: of its own rank (its steps slowed) and of its
//!   peers (they waited for that rank);
//! - a late arrival or slow rank that spent most of its lateness blocked
//!   in a device call (the collective detector's `waited` evidence: a
//!   sync on a receive from a pipeline peer) inherited it: another rank's
//!   delay, stall or contention under way while it waited explains it,
//!   whatever the steps between them;
//! - a late arrival explains a later late arrival that it overlaps (or
//!   that comes in the catch-up just after it): of
//!   another rank (it waited for the first, e.g. a pipeline peer), or of
//!   its own rank (one delay seen at two communicators).
//!
//! The grouping is over a run's findings once they are all known (`agent
//! diagnose`, the end of `agent attach`): a consequence is often found
//! before its cause (a waiting peer's hang before the dead rank's exit),
//! and a run of steps (contention, a host-bound rank) reported when it
//! had held long enough has by then been stretched to its whole run
//! ([`run_spans`](super::run_spans)).

use std::collections::{BTreeMap, BTreeSet};

use crate::model::finding::IncidentLink;
use crate::model::{Finding, FindingKind};

/// Steps apart at most for a finding to explain another.
const STEP_SLACK: u64 = 1;

/// What to look at first: what stopped the job, then what slowed it.
pub fn importance(kind: FindingKind) -> u8 {
    match kind {
        FindingKind::Hang => 0,
        FindingKind::Crash => 1,
        FindingKind::DeviceOom => 2,
        FindingKind::DeviceError => 3,
        FindingKind::DeviceThrottled => 4,
        FindingKind::SlowRank => 5,
        FindingKind::SlowLink => 6,
        FindingKind::HostContention => 7,
        FindingKind::HostBound => 8,
        FindingKind::DataloaderStall => 9,
        FindingKind::MemoryLeak => 10,
        FindingKind::LateArrival => 11,
    }
}

fn is_fatal(kind: FindingKind) -> bool {
    matches!(
        kind,
        FindingKind::Crash | FindingKind::DeviceError | FindingKind::DeviceOom
    )
}

/// The ranks listed in `v`, an array of numbers.
fn ranks_in(v: &serde_json::Value) -> BTreeSet<u32> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_u64())
        .map(|v| v as u32)
        .collect()
}

/// The ranks stuck in a hang (its evidence's `stuck`).
fn stuck_ranks(f: &Finding) -> impl Iterator<Item = u32> + '_ {
    f.evidence["stuck"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["rank"].as_u64())
        .map(|v| v as u32)
}

/// The ranks a hang finding's members wait with: those that entered the
/// operation, or are stuck in it.
fn waiting_ranks(f: &Finding) -> BTreeSet<u32> {
    let mut r = ranks_in(&f.evidence["entered"]);
    r.extend(stuck_ranks(f));
    r
}

/// A hang every member entered (none is missing from it).
fn missing_none(f: &Finding) -> bool {
    f.evidence["never_entered"]
        .as_array()
        .is_none_or(|a| a.is_empty())
}

/// The ranks a hang's stuck ranks wait for point to point (its
/// `p2p_waits`' peers).
fn p2p_peers(f: &Finding) -> BTreeSet<u32> {
    f.evidence["p2p_waits"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w["peer"].as_u64())
        .map(|v| v as u32)
        .collect()
}

/// The ranks a hang holds up: those that never entered it and those stuck
/// in it.
fn held_ranks(g: &Finding) -> BTreeSet<u32> {
    let mut r = ranks_in(&g.evidence["never_entered"]);
    r.extend(stuck_ranks(g));
    r
}

/// Whether hang `f`, missing no member, waits point to point for ranks
/// that all never entered hang `g` or are stuck in it.
fn waits_into(g: &Finding, f: &Finding) -> bool {
    let peers = p2p_peers(f);
    if peers.is_empty() || !missing_none(f) {
        return false;
    }
    let held = held_ranks(g);
    peers.iter().all(|r| held.contains(r))
}

fn shares_rank(a: &Finding, b: &Finding) -> bool {
    a.ranks.iter().any(|r| b.ranks.contains(r))
}

/// Whether cause `g` and `f` are steps apart at most [`STEP_SLACK`]: for a
/// cause of one step (a stall, a late arrival); a run of steps (host
/// contention, a slow rank) is dated by its first, its span decides.
fn steps_close(g: &Finding, f: &Finding) -> bool {
    if !matches!(
        g.kind,
        FindingKind::DataloaderStall | FindingKind::LateArrival
    ) {
        return true;
    }
    match (g.step, f.step) {
        (Some(x), Some(y)) => x.abs_diff(y) <= STEP_SLACK,
        _ => true,
    }
}

/// Whether `g`'s time span overlaps `f`'s (an open end runs on).
fn overlaps(g: &Finding, f: &Finding) -> bool {
    let g_end = g.end_ns.unwrap_or(u64::MAX);
    let f_end = f.end_ns.unwrap_or(u64::MAX);
    g.start_ns <= f_end && f.start_ns <= g_end
}

/// Whether `f` overlaps `g` or begins within a quarter of `g`'s length
/// after it: when a rank that held the others up for a while comes back,
/// every rank resumes at once and the scheduler serves them one after
/// another (seen: after a 1 s delay on 2 CPUs, four ranks 10-14 ms late
/// at the next all-gathers, 6 ms after the delayed rank arrived).
fn overlaps_or_follows(g: &Finding, f: &Finding) -> bool {
    let g_end = g.end_ns.unwrap_or(u64::MAX);
    let tail = g_end.saturating_sub(g.start_ns) / 4;
    let f_end = f.end_ns.unwrap_or(u64::MAX);
    g.start_ns <= f_end && f.start_ns <= g_end.saturating_add(tail)
}

/// When a late rank spent most of its lateness blocked in a device call
/// (a sync on a receive, a blocking send: the collective detector's
/// `waited` evidence), it was waiting for someone: the end of that wait.
/// Its lateness is inherited, not its own.
fn inherited_until(f: &Finding) -> Option<u64> {
    let waited = &f.evidence["waited"];
    let ms = waited["ms"].as_f64()?;
    let delay = f.evidence["delay_ms"]
        .as_f64()
        .or_else(|| f.evidence["median_delay_ms"].as_f64())?;
    (ms * 2.0 >= delay).then(|| waited["until_ns"].as_u64())?
}

fn top_preemptor(f: &Finding) -> Option<u64> {
    f.evidence["preemptors"].get(0)?["pid"].as_u64()
}

/// A contention of the job's steps as a whole (every rank alike), not of
/// one rank.
fn is_job_level(f: &Finding) -> bool {
    f.evidence["scope"] == "job"
}

/// Whether the top preemptor of a contention is a rank of a traced job.
fn taken_by_a_rank(f: &Finding) -> bool {
    f.evidence["preemptors"]
        .get(0)
        .is_some_and(|p| p["traced"] == true && p["rank"].is_u64())
}

/// Whether `g` explains `f`, and how strongly (lower: a stronger cause).
/// `g_first`: `g` comes before `f` (time, then position), the tie-break
/// between two findings of one kind.
fn explains(g: &Finding, f: &Finding, g_first: bool) -> Option<u8> {
    use FindingKind::*;
    match f.kind {
        Hang => {
            if f.ranks.is_empty() {
                return None;
            }
            if is_fatal(g.kind) && shares_rank(g, f) {
                return Some(0);
            }
            if g.kind == Hang {
                let waiting = waiting_ranks(g);
                if f.ranks.iter().all(|r| waiting.contains(r)) {
                    return Some(1);
                }
                // Its stuck ranks wait point to point for ranks that are
                // missing from `g` or stuck in it.
                if waits_into(g, f) {
                    return Some(1);
                }
                if g_first && shares_rank(g, f) && !waits_into(f, g) {
                    return Some(2);
                }
                // Every member entered and none left: they wait inside it
                // on work their streams hold behind something else (a
                // pipeline send or receive to a peer that is itself stuck),
                // which the host sees only where it counted the sends and
                // receives (`p2p_waits`); without them, a hang that a rank
                // never entered, open at the same time, is what the job
                // waits for.
                if missing_none(f) && p2p_peers(f).is_empty() && !missing_none(g) && overlaps(g, f)
                {
                    return Some(3);
                }
            }
            None
        }
        Crash => {
            (g.kind != Crash && is_fatal(g.kind) && shares_rank(g, f) && g.start_ns <= f.start_ns)
                .then_some(0)
        }
        DeviceOom => (g.kind == MemoryLeak && shares_rank(g, f)).then_some(0),
        LateArrival | SlowRank => {
            // Late at an operation that then hung: part of the hang.
            if g.kind == Hang && g.comm.is_some() && g.comm == f.comm && g.seq == f.seq {
                return Some(2);
            }
            // A throttled GPU slows its rank's steps, and its peers wait
            // for that rank: lateness while it lasts (it is open until the
            // clock comes back) follows from it, whoever's it is.
            if g.kind == DeviceThrottled && overlaps(g, f) {
                return Some(2);
            }
            // It waited, blocked in a device call, for most of its
            // lateness: another rank's delay that was under way while it
            // waited (begun before its wait ended, not over before its
            // lateness began) is what it waited for, however many steps
            // the catch-up takes.
            if let Some(until) = inherited_until(f)
                && !shares_rank(g, f)
                && matches!(
                    g.kind,
                    LateArrival | SlowRank | DataloaderStall | HostContention | HostBound
                )
                && g.start_ns <= until
                && g.end_ns.unwrap_or(u64::MAX) >= f.start_ns
            {
                return Some(1);
            }
            // Contention is dated from steps whose share flickers (a rank
            // sharing its CPU with siblings and a neighbour is preempted by
            // one or the other): its onset can trail the neighbour by a
            // step or two, so it explains lateness up to two of its steps
            // before it.
            if g.kind == HostContention {
                let lead = (g.evidence["step_ms"].as_f64().unwrap_or(0.0) * 2e6) as u64;
                let start = g.start_ns.saturating_sub(lead);
                let g_end = g.end_ns.unwrap_or(u64::MAX);
                let tail = g_end.saturating_sub(g.start_ns) / 4;
                let f_end = f.end_ns.unwrap_or(u64::MAX);
                return (start <= f_end && f.start_ns <= g_end.saturating_add(tail)).then_some(3);
            }
            if !steps_close(g, f) || !overlaps_or_follows(g, f) {
                return None;
            }
            match g.kind {
                DataloaderStall | HostContention | HostBound => Some(3),
                // Another rank's: it waited for that one. Its own: one
                // delay seen at two collectives (its peers on another
                // communicator waited for it too).
                LateArrival | SlowRank if g_first => Some(4),
                _ => None,
            }
        }
        HostContention => {
            // An outsider every rank of the job suffers (one finding of
            // the job's steps) explains a rank's own contention under it,
            // whatever took that rank's CPU most; never the other way.
            if is_job_level(g) != is_job_level(f) {
                return (g.kind == HostContention
                    && is_job_level(g)
                    && shares_rank(g, f)
                    && overlaps(g, f))
                .then_some(2);
            }
            let same_taker = top_preemptor(g).is_some() && top_preemptor(g) == top_preemptor(f);
            // Ranks taking one another's CPUs (more ranks than CPUs): what
            // every rank suffers alike is one job-level incident.
            let siblings = taken_by_a_rank(g) && taken_by_a_rank(f);
            (g.kind == HostContention && g_first && (same_taker || siblings)).then_some(3)
        }
        DataloaderStall | HostBound | MemoryLeak | SlowLink | DeviceError | DeviceThrottled => None,
    }
}

/// What each of `found` follows from: the index of the finding that
/// explains it best (the strongest explanation, then the earliest), None
/// for a root. The one judgement behind [`group`] and the detect sink's
/// links of findings as they stream.
pub fn causes(found: &[Finding]) -> Vec<Option<usize>> {
    causes_where(found, |_, _| true)
}

/// Whether a finding streamed as it is made may be linked to `cause`
/// before the run's findings are all known. Not one rank's lateness to
/// another's: with host evidence alone two ranks late together can each
/// look like the one the other waited for (two tensor-parallel peers,
/// each blocked in its stream sync, late at their data-parallel
/// all-reduces within microseconds of each other), and the first to begin
/// is no better than a guess. What a stall, contention, a hang, a
/// throttled device, a crash or a leak explains has one direction.
pub fn streamed_link_holds(cause: &Finding, f: &Finding) -> bool {
    let lateness = |k: FindingKind| matches!(k, FindingKind::LateArrival | FindingKind::SlowRank);
    !(lateness(cause.kind) && lateness(f.kind))
}

/// [`causes`] with only the explanations `accept` (cause, finding) takes.
pub fn causes_where(
    found: &[Finding],
    accept: impl Fn(&Finding, &Finding) -> bool,
) -> Vec<Option<usize>> {
    let n = found.len();
    // Time order decides "earlier" between findings of one kind.
    let mut by_time: Vec<usize> = (0..n).collect();
    by_time.sort_by_key(|&i| (found[i].start_ns, i));
    let mut when = vec![0; n];
    for (pos, &i) in by_time.iter().enumerate() {
        when[i] = pos;
    }
    let mut cause: Vec<Option<usize>> = (0..n)
        .map(|i| {
            (0..n)
                .filter(|&j| j != i && accept(&found[j], &found[i]))
                .filter_map(|j| {
                    explains(&found[j], &found[i], when[j] < when[i]).map(|s| (s, when[j], j))
                })
                .min()
                .map(|(_, _, j)| j)
        })
        .collect();
    // A cycle (ranks waiting for one another: a deadlock) has its earliest
    // finding as the root.
    for i in 0..n {
        let mut seen = vec![i];
        let mut at = i;
        while let Some(next) = cause[at] {
            if let Some(pos) = seen.iter().position(|&s| s == next) {
                let first = *seen[pos..]
                    .iter()
                    .min_by_key(|&&s| when[s])
                    .unwrap_or(&next);
                cause[first] = None;
                break;
            }
            seen.push(next);
            at = next;
        }
    }
    // A hang every member entered whose point-to-point waits point to
    // ranks that several hangs hold up, none of them all (a data-parallel
    // group's ranks each waiting to receive from a pipeline peer stuck in
    // its own tensor-parallel all-gather): it follows from those hangs
    // when they all lead back to one fault (the earliest of them stands
    // for it). Assigned after the cycles are broken: a root's chain is
    // final, and it is never this hang's own.
    for i in 0..n {
        let f = &found[i];
        if cause[i].is_some() || f.kind != FindingKind::Hang || !missing_none(f) {
            continue;
        }
        let peers = p2p_peers(f);
        if peers.is_empty() {
            continue;
        }
        let holders: Vec<usize> = (0..n)
            .filter(|&j| {
                j != i
                    && found[j].kind == FindingKind::Hang
                    && accept(&found[j], f)
                    && !held_ranks(&found[j]).is_disjoint(&peers)
            })
            .collect();
        let held: BTreeSet<u32> = holders
            .iter()
            .flat_map(|&j| held_ranks(&found[j]))
            .collect();
        if !peers.is_subset(&held) {
            continue;
        }
        let roots: BTreeSet<usize> = holders.iter().map(|&j| root_of(&cause, j)).collect();
        if roots.len() == 1 && !roots.contains(&i) {
            cause[i] = holders.iter().copied().min_by_key(|&j| when[j]);
        }
    }
    cause
}

/// The root finding `i` leads back to by `cause` (as [`causes`] gives it:
/// without cycles).
fn root_of(cause: &[Option<usize>], mut i: usize) -> usize {
    while let Some(c) = cause[i] {
        i = c;
    }
    i
}

/// Groups `found` into incidents: orders it roots first (by importance,
/// then time), each root followed by its consequences (by time), and
/// sets every finding's `id`, `incident` and, on consequences, `cause`.
pub fn group(found: &mut Vec<Finding>) {
    let n = found.len();
    let cause = causes(found);
    let mut by_time: Vec<usize> = (0..n).collect();
    by_time.sort_by_key(|&i| (found[i].start_ns, i));
    let roots: Vec<usize> = {
        let mut r: Vec<usize> = (0..n).filter(|&i| cause[i].is_none()).collect();
        r.sort_by_key(|&i| (importance(found[i].kind), found[i].start_ns, i));
        r
    };
    let mut members: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for &i in &by_time {
        if cause[i].is_some() {
            members.entry(root_of(&cause, i)).or_default().push(i);
        }
    }
    let order: Vec<(usize, u32)> = roots
        .iter()
        .enumerate()
        .flat_map(|(k, &r)| {
            std::iter::once(r)
                .chain(members.get(&r).into_iter().flatten().copied())
                .map(move |i| (i, k as u32 + 1))
        })
        .collect();
    let mut id_of = vec![0u32; n];
    for (pos, &(i, _)) in order.iter().enumerate() {
        id_of[i] = pos as u32 + 1;
    }
    let mut old: Vec<Option<Finding>> = std::mem::take(found).into_iter().map(Some).collect();
    for (i, incident) in order {
        let mut f = old[i].take().expect("each finding once");
        f.link = IncidentLink {
            id: Some(id_of[i]),
            incident: Some(incident),
            cause: cause[i].map(|c| id_of[c]),
            // The stream's provisional link: `cause` says it now.
            follows_from: None,
        };
        found.push(f);
    }
}

/// The line that folds a root's consequences ("+4 ranks waited for it
/// (hang x3, late_arrival x1)"), None for a root without any. `found` is
/// grouped ([`group`]).
pub fn folded(found: &[Finding], root: &Finding) -> Option<String> {
    let incident = root.link.incident?;
    let consequences: Vec<&Finding> = found
        .iter()
        .filter(|f| f.link.incident == Some(incident) && f.link.cause.is_some())
        .collect();
    if consequences.is_empty() {
        return None;
    }
    // Who waited: the root hang's own waiting members too.
    let root_waiting = match root.kind {
        FindingKind::Hang => waiting_ranks(root),
        _ => BTreeSet::new(),
    };
    let ranks: BTreeSet<u32> = consequences
        .iter()
        .flat_map(|f| {
            // A hang's waiting ranks are who waited; other kinds name them.
            if f.kind == FindingKind::Hang {
                waiting_ranks(f)
            } else {
                f.ranks.iter().copied().collect()
            }
        })
        .chain(root_waiting)
        .filter(|r| !root.ranks.contains(r))
        .collect();
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for f in &consequences {
        *kinds.entry(f.kind.as_str()).or_default() += 1;
    }
    let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} x{n}")).collect();
    let listed: Vec<String> = ranks.iter().map(u32::to_string).collect();
    let who = match ranks.len() {
        // Consequences on the root's own ranks only (a rank's own
        // contention under the job's).
        0 => {
            return Some(format!(
                "+{} consequence finding(s) on its own ranks: {}",
                consequences.len(),
                kinds.join(", ")
            ));
        }
        1 => format!("+1 rank waited for it (rank {})", listed[0]),
        n => format!("+{n} ranks waited for it (ranks {})", listed.join(", ")),
    };
    Some(format!(
        "{who}; {} consequence finding(s): {}",
        consequences.len(),
        kinds.join(", ")
    ))
}

/// The findings as a person reads them: each root's headline and
/// evidence, its consequences folded into one line.
pub fn text(found: &[Finding]) -> String {
    let mut out = String::new();
    for f in found.iter().filter(|f| f.link.cause.is_none()) {
        out += &format!("{}\n    evidence: {}\n", f.headline(), f.evidence);
        if let Some(line) = folded(found, f) {
            out += &format!("    {line}\n");
        }
    }
    out
}

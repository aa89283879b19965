//! Which dumps are taken, and which are kept when the directory is full.
//!
//! Any traced process can make the recorder dump: dying on a fault signal
//! is a crash finding. So a burst of cheap crashes must neither use up the
//! dumps a real incident needs nor later push its dump out of the
//! directory:
//!
//! - Every dump has a [`Retention`] class. Incidents are what a person is
//!   paged for: a hang, a device that failed (OOM, device error), a job's
//!   first crash, and a dump a person asked for. The rest (later crashes
//!   of the same job, performance findings) are routine.
//! - Rate limits are per trigger and job (`max_dumps_per_hour` each), and
//!   per class (four times that over all jobs), so one job's or one
//!   trigger's flood leaves the others their dumps, and routine dumps
//!   never take an incident's.
//! - When the directory is over its bound, routine dumps go first (oldest
//!   first), incidents only when no routine dump is left.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::Trigger;
use super::dump::RateLimiter;

/// How a dump is treated by the rate limits and the directory's bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Retention {
    Incident,
    Routine,
}

impl Retention {
    pub fn as_str(self) -> &'static str {
        match self {
            Retention::Incident => "incident",
            Retention::Routine => "routine",
        }
    }
}

/// Limiters kept for at most this many (trigger, job) pairs; and at most
/// this many jobs remembered as having crashed once. Job labels come from
/// traced processes' environments: without a bound, a process naming a
/// new job per crash would grow the agent.
const MAX_KEYS: usize = 1024;

/// The class-wide limit is this many times the per-job one.
const CLASS_FACTOR: u32 = 4;

/// Why a dump was refused.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    /// The limit that refused it (per hour).
    pub per_hour: u32,
    /// What it applies to, for the message ("hang dumps of job x").
    pub scope: String,
    pub retry_after: Duration,
}

/// The recorder's dump limits.
#[derive(Debug)]
pub struct DumpLimits {
    per_hour: u32,
    per_key: HashMap<(Trigger, String), RateLimiter>,
    per_class: HashMap<Retention, RateLimiter>,
    /// Jobs whose first crash was dumped (later crashes are routine).
    crashed: HashSet<String>,
}

impl DumpLimits {
    pub fn new(per_hour: u32) -> Self {
        Self {
            per_hour,
            per_key: HashMap::new(),
            per_class: HashMap::new(),
            crashed: HashSet::new(),
        }
    }

    /// The class a dump of `trigger` for `job` would have now.
    pub fn class(&self, trigger: Trigger, job: &str) -> Retention {
        match trigger {
            Trigger::Manual | Trigger::Hang | Trigger::Oom => Retention::Incident,
            Trigger::Signal if !self.crashed.contains(job) && self.crashed.len() < MAX_KEYS => {
                Retention::Incident
            }
            Trigger::Signal | Trigger::Slowdown => Retention::Routine,
        }
    }

    /// Takes a dump of `trigger` for `job` at `now` (its class), or says
    /// which limit refused it.
    pub fn take(
        &mut self,
        trigger: Trigger,
        job: &str,
        now: Instant,
    ) -> Result<Retention, Refused> {
        let class = self.class(trigger, job);
        let key = (trigger, job.to_string());
        if !self.per_key.contains_key(&key) && self.per_key.len() >= MAX_KEYS {
            // Forget the pairs with no dump in the last hour.
            self.per_key.retain(|_, l| !l.idle(now));
        }
        let scope = || format!("{} dumps of job {job}", trigger.as_str());
        let per_hour = self.per_hour;
        if !self.per_key.contains_key(&key) && self.per_key.len() >= MAX_KEYS {
            return Err(Refused {
                per_hour,
                scope: format!("dumps of more than {MAX_KEYS} jobs and triggers"),
                retry_after: Duration::from_secs(60),
            });
        }
        // Both limits are checked before either is taken: a dump refused
        // by its class does not use its job's share.
        let class_limit = per_hour.saturating_mul(CLASS_FACTOR);
        let class_limiter = self
            .per_class
            .entry(class)
            .or_insert_with(|| RateLimiter::new(class_limit));
        if let Err(retry_after) = class_limiter.check(now) {
            return Err(Refused {
                per_hour: class_limit,
                scope: format!("{} dumps", class.as_str()),
                retry_after,
            });
        }
        let key_limiter = self
            .per_key
            .entry(key)
            .or_insert_with(|| RateLimiter::new(per_hour));
        if let Err(retry_after) = key_limiter.take(now) {
            return Err(Refused {
                per_hour,
                scope: scope(),
                retry_after,
            });
        }
        let _ = self
            .per_class
            .get_mut(&class)
            .map(|l| l.take(now))
            .transpose();
        if trigger == Trigger::Signal && class == Retention::Incident {
            self.crashed.insert(job.to_string());
        }
        Ok(class)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_flood_leaves_other_jobs_and_incidents_their_dumps() {
        let mut l = DumpLimits::new(3);
        let t = Instant::now();
        // One job crashing over and over: its first crash is an incident,
        // the next two routine, then its share is used.
        assert_eq!(l.take(Trigger::Signal, "flood", t), Ok(Retention::Incident));
        assert_eq!(l.take(Trigger::Signal, "flood", t), Ok(Retention::Routine));
        assert_eq!(l.take(Trigger::Signal, "flood", t), Ok(Retention::Routine));
        let refused = l.take(Trigger::Signal, "flood", t).unwrap_err();
        assert_eq!(refused.scope, "signal dumps of job flood");
        // Another job's first crash, and a hang of the flooding job, are
        // still dumped as incidents.
        assert_eq!(l.take(Trigger::Signal, "train", t), Ok(Retention::Incident));
        assert_eq!(l.take(Trigger::Hang, "flood", t), Ok(Retention::Incident));
    }

    #[test]
    fn routine_dumps_over_many_jobs_stop_at_the_class_limit_not_before_incidents() {
        let mut l = DumpLimits::new(2);
        let t = Instant::now();
        let mut routine = 0;
        for job in 0..20 {
            if l.take(Trigger::Slowdown, &format!("j{job}"), t).is_ok() {
                routine += 1;
            }
        }
        assert_eq!(routine, 8, "four times the per-job limit");
        let refused = l.take(Trigger::Slowdown, "another", t).unwrap_err();
        assert_eq!(refused.scope, "routine dumps");
        // The refusals used nobody's share; incidents are unaffected.
        assert_eq!(l.take(Trigger::Oom, "j0", t), Ok(Retention::Incident));
        // An hour later the routine class has room again.
        let later = t + Duration::from_secs(3601);
        assert_eq!(
            l.take(Trigger::Slowdown, "j0", later),
            Ok(Retention::Routine)
        );
    }

    #[test]
    fn job_labels_a_process_invents_are_bounded() {
        let mut l = DumpLimits::new(1_000_000);
        let t = Instant::now();
        for job in 0..(MAX_KEYS + 10) {
            let _ = l.take(Trigger::Slowdown, &format!("j{job}"), t);
        }
        assert!(l.per_key.len() <= MAX_KEYS);
        let later = t + Duration::from_secs(3601);
        assert!(l.take(Trigger::Slowdown, "new", later).is_ok());
        assert!(l.per_key.len() <= MAX_KEYS);
    }
}

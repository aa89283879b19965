//! A process's place in the training job, from its environment
//! (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, and the job label from the first
//! variable of a list that it sets: [`job_label`]).

/// The variables naming a process's job when none are configured
/// (`agent attach`, and `labels.job_env`'s default): the agent's own, the
/// usual scheduler's, torchrun's.
pub const DEFAULT_JOB_ENV: [&str; 3] = ["XPUSCOPE_JOB", "JOB_NAME", "TORCHELASTIC_RUN_ID"];

/// Longest label value kept: environment values are the traced process's
/// to fill, and they become metric labels and file names.
const MAX_VALUE_CHARS: usize = 128;

/// [`DEFAULT_JOB_ENV`] as owned names.
pub fn default_job_env() -> Vec<String> {
    DEFAULT_JOB_ENV.map(String::from).to_vec()
}

/// The job label of a process with environment `environ` (NUL-separated):
/// the value of the first of `names` it sets. Every consumer (metrics,
/// dumps, detectors, the process list) reads it here, so one list decides.
/// An empty value names no job: the next name is tried, as a launcher that
/// clears a variable rather than unsetting it means.
pub fn job_label(environ: &[u8], names: &[String]) -> Option<String> {
    names.iter().find_map(|name| {
        environ.split(|&b| b == 0).find_map(|var| {
            let value = var.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
            let value = std::str::from_utf8(value).ok()?;
            (!value.is_empty()).then(|| value.chars().take(MAX_VALUE_CHARS).collect())
        })
    })
}

/// Rank identity from a process's environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankIdentity {
    pub rank: Option<String>,
    pub local_rank: Option<String>,
    pub world_size: Option<String>,
    pub job: Option<String>,
}

impl RankIdentity {
    /// With the job label from [`DEFAULT_JOB_ENV`].
    #[cfg(test)]
    pub fn from_environ(environ: &[u8]) -> Self {
        Self::from_environ_with(environ, &default_job_env())
    }

    /// With the job label from the first of `job_env` set ([`job_label`]).
    pub fn from_environ_with(environ: &[u8], job_env: &[String]) -> Self {
        let mut id = Self {
            job: job_label(environ, job_env),
            ..Self::default()
        };
        for var in environ.split(|&b| b == 0) {
            let Ok(var) = std::str::from_utf8(var) else {
                continue;
            };
            let Some((k, v)) = var.split_once('=') else {
                continue;
            };
            let v = Some(v.chars().take(MAX_VALUE_CHARS).collect::<String>());
            match k {
                "RANK" => id.rank = v,
                "LOCAL_RANK" => id.local_rank = v,
                "WORLD_SIZE" => id.world_size = v,
                _ => {}
            }
        }
        id
    }

    /// Reads `pid`'s environment (call while it certainly lives: at probe
    /// planning), the job label from [`DEFAULT_JOB_ENV`].
    pub fn read(pid: u32) -> Self {
        Self::read_with(pid, &default_job_env())
    }

    /// [`Self::read`] with the job label from the first of `job_env` set.
    pub fn read_with(pid: u32, job_env: &[String]) -> Self {
        std::fs::read(format!("/proc/{pid}/environ"))
            .map(|b| Self::from_environ_with(&b, job_env))
            .unwrap_or_default()
    }

    /// "rank 3/8 job sim-x", or None without a rank.
    pub fn name(&self) -> Option<String> {
        let rank = self.rank.as_ref()?;
        let mut s = format!("rank {rank}");
        if let Some(w) = &self.world_size {
            s.push_str(&format!("/{w}"));
        }
        if let Some(j) = &self.job {
            s.push_str(&format!(" job {j}"));
        }
        Some(s)
    }

    pub fn labels(&self) -> Vec<String> {
        let mut labels = Vec::new();
        if let Some(r) = &self.rank {
            labels.push(format!("rank={r}"));
        }
        if let Some(r) = &self.local_rank {
            labels.push(format!("local_rank={r}"));
        }
        if let Some(w) = &self.world_size {
            labels.push(format!("world_size={w}"));
        }
        if let Some(j) = &self.job {
            labels.push(format!("job={j}"));
        }
        labels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_identity_from_environ() {
        let env =
            b"PATH=/bin\0RANK=3\0WORLD_SIZE=8\0LOCAL_RANK=1\0JOB_NAME=j\0XPUSCOPE_JOB=sim-a\0";
        let id = RankIdentity::from_environ(env);
        assert_eq!(id.name().as_deref(), Some("rank 3/8 job sim-a"));
        assert_eq!(
            id.labels(),
            vec!["rank=3", "local_rank=1", "world_size=8", "job=sim-a"]
        );
        let id = RankIdentity::from_environ(b"JOB_NAME=j\0");
        assert_eq!(id.name(), None);
        assert_eq!(id.job.as_deref(), Some("j"));
    }

    #[test]
    fn the_job_label_comes_from_the_first_configured_variable_set() {
        let env = b"JOB_NAME=llama\0XPUSCOPE_JOB=\0MY_JOB=mine\0MY_JOBX=no\0RANK=1\0";
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // An empty value names no job: the next variable decides.
        assert_eq!(job_label(env, &default_job_env()).as_deref(), Some("llama"));
        assert_eq!(
            job_label(env, &names(&["MY_JOB", "JOB_NAME"])).as_deref(),
            Some("mine")
        );
        assert_eq!(job_label(env, &names(&["MY_JO", "NONE"])), None);
        assert_eq!(job_label(env, &[]), None);
        let id = RankIdentity::from_environ_with(env, &names(&["MY_JOB"]));
        assert_eq!(id.job.as_deref(), Some("mine"));
        assert_eq!(id.rank.as_deref(), Some("1"));
        // Only the configured list: a default variable alone is no label.
        let id = RankIdentity::from_environ_with(b"XPUSCOPE_JOB=x\0", &names(&["MY_JOB"]));
        assert_eq!(id.job, None);
        let long = format!("MY_JOB={}\0", "j".repeat(300));
        let job = job_label(long.as_bytes(), &names(&["MY_JOB"])).unwrap();
        assert_eq!(job.len(), MAX_VALUE_CHARS);
    }
}

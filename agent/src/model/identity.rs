//! A process's place in the training job, from its environment
//! (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `XPUSCOPE_JOB`/`JOB_NAME`).

/// Rank identity from a process's environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankIdentity {
    pub rank: Option<String>,
    pub local_rank: Option<String>,
    pub world_size: Option<String>,
    pub job: Option<String>,
}

impl RankIdentity {
    pub fn from_environ(environ: &[u8]) -> Self {
        let mut id = Self::default();
        let mut job_name = None;
        for var in environ.split(|&b| b == 0) {
            let Ok(var) = std::str::from_utf8(var) else {
                continue;
            };
            let Some((k, v)) = var.split_once('=') else {
                continue;
            };
            let v = Some(v.chars().take(128).collect::<String>());
            match k {
                "RANK" => id.rank = v,
                "LOCAL_RANK" => id.local_rank = v,
                "WORLD_SIZE" => id.world_size = v,
                "XPUSCOPE_JOB" => id.job = v,
                "JOB_NAME" => job_name = v,
                _ => {}
            }
        }
        if id.job.is_none() {
            id.job = job_name;
        }
        id
    }

    /// Reads `pid`'s environment (call while it certainly lives: at probe
    /// planning).
    pub fn read(pid: u32) -> Self {
        std::fs::read(format!("/proc/{pid}/environ"))
            .map(|b| Self::from_environ(&b))
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
}

//! Helpers every benchmark part uses (so the parts do not depend on each
//! other): waiting for the agent to record, and a median.

use std::io::{BufRead, BufReader};

use anyhow::{Context, Result, bail};

/// Waits for the agent's "recording" line on its (piped) stderr, then keeps
/// draining stderr so the agent never blocks on a full pipe.
pub fn wait_until_recording(agent: &mut std::process::Child) -> Result<()> {
    let stderr = agent.stderr.take().context("agent stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains("xpuscope: recording") => break,
            Some(Ok(_)) => continue,
            _ => bail!("the agent stopped before recording"),
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Ok(())
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

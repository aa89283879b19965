pub fn run(_seconds: u64) -> anyhow::Result<()> { anyhow::bail!("benchmarks: not written yet") }

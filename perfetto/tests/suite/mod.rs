mod common;
mod samples;
mod sched;
mod size;
mod system;
mod track_events;

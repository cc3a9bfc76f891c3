//! Watching a run learn: its training scalars as TensorBoard event files under `<out>/tb/`
//! ([`scalars`], written with [`events`]).

pub mod events;
pub mod scalars;

//! Watching a run learn: its training scalars as TensorBoard event files under `<out>/tb/`
//! ([`scalars`], written with [`events`]), and the live dashboard page with the JSON it
//! refreshes from ([`dashboard`]).

pub mod dashboard;
pub mod events;
pub mod scalars;

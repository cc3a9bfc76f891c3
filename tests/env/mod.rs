//! Environments: episodes and sessions over the sandbox, the SWE repositories, the GUI browser, and `clawrl sandbox`.

mod browser_confinement;
mod episodes;
mod gui;
mod sandbox_cli;
mod sessions;
mod swe;

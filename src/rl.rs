//! rl (being written).

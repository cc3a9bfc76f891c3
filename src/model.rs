//! model (being written).

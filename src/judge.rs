//! judge (being written).

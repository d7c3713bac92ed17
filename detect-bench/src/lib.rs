//! A labelled detection benchmark for the telemetry rules (issue 32): SIMULATED 8-GPU nodes
//! (`model`) with every pathology at several severities, onsets, durations and duty cycles and
//! healthy look-alikes (`cases`), sampled as a given agent version samples (`sampler`), run
//! through the telemetry crate's detector and scored per rule (`score`). Nothing here is measured
//! on hardware: it says how the rules behave on series shaped like the measured ones.

pub mod cases;
pub mod model;
pub mod sampler;
pub mod score;

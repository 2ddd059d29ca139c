//! PLACEHOLDER: the seeded simulator.

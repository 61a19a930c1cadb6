//! Test helpers shared by several Kiln crates (dev-dependency only).

pub mod fake_hub;
pub mod special_files;

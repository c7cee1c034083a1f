//! Real `pie serve` workers (test model) behind a real `pie-controller`:
//! one test binary (`cargo test --test cluster`), a module per feature;
//! `harness` starts the clusters the tests share.

#[path = "../common/mod.rs"]
mod common;
mod harness;

mod actors;
mod disaggregate;
mod inferlets;
mod kv_events;
mod lifecycle;
mod moves;
mod native_moves;
mod openai;
mod queueing;
mod registration;
mod routing;
mod tenancy;
mod tokenize;

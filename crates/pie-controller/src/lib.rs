//! `pie-controller`: fronts many workers with the worker's own client API.
//! Modules in layers, each importing only from layers below it (the map and
//! the rule are in ARCHITECTURE.md):
//!
//! - leaves: [`config`], [`metrics`], [`clients`], [`trace`], [`respond`]
//!   (the controller's own answers), [`caller`] (who asks, who the controller
//!   acts for);
//! - [`worker_client`]: every call to a worker;
//! - state that needs no [`controller::Controller`]: [`registry`] (workers,
//!   health, load, prefix index), [`model`] (the tokenizer routing uses),
//!   [`routing`] (one routing decision), [`kv_sync`] (the workers' KV event
//!   streams), [`admission`] (the wait for a slot), [`streams`] (the table of
//!   movable streams), [`actors`] (the actors' state and log);
//! - [`controller`]: all of it together, built from a config and reloaded;
//! - flows that move work: [`in_flight`], [`placed`], [`relay`] (streams that
//!   move), [`whole`] (non-streamed answers gathered from one), [`native`]
//!   (native processes that move), [`actor_loop`] (the actors at work);
//! - [`api`]: the HTTP routes.

pub mod actor_loop;
pub mod actors;
pub mod admission;
pub mod api;
pub mod caller;
pub mod clients;
pub mod config;
pub mod controller;
pub mod in_flight;
pub mod install_sync;
pub mod installs;
pub mod kv_sync;
pub mod live_move;
pub mod metrics;
pub mod model;
pub mod native;
pub mod placed;
pub mod registry;
pub mod relay;
pub mod respond;
pub mod routing;
pub mod streams;
pub mod trace;
pub mod usage;
pub mod whole;
pub mod worker_client;

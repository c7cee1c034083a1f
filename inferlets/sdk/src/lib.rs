//! Guest SDK for Pie inferlets: programs the worker runs as processes, built
//! as WebAssembly components for the `pie:inferlet@0.3.0` world (`wit/`: the
//! 0.1.0 interfaces; 0.2.0's `structured`, `reporting` and `shaping`; 0.3.0's
//! `passes` and `steering`). A component imports only the interfaces it
//! calls, so one that calls nothing of 0.3.0 loads on a 0.2.0 worker.
//!
//! ```ignore
//! use pie_inferlet::{Context, GenerateOptions};
//!
//! fn run() -> Result<(), String> {
//!     let ctx = Context::new()?;
//!     ctx.append_text("The capital of France is")?;
//!     ctx.generate(&GenerateOptions::new().max_tokens(16).stream(true))?;
//!     Ok(())
//! }
//!
//! pie_inferlet::main!(run);
//! ```
//!
//! - [`Context`]: a token sequence in the engine's KV pool, freed on drop:
//!   append, fork, generate, [`forward`](Context::forward), and (0.3.0)
//!   [`pass`](Context::pass) (the distributions after several positions in
//!   one step), [`truncate`](Context::truncate) and
//!   [`set_token_sets`](Context::set_token_sets).
//! - [`Pending`]: an operation in flight, from
//!   [`Context::start_generate`], [`Context::start_pass`] or
//!   [`start_receive`]; wait for one, for all ([`wait_all`]) or for the first
//!   done ([`wait_any`]). Every operation in flight is batched into the same
//!   engine steps.
//! - [`GenerateOptions`] / [`Sampling`]: greedy, 256 tokens, no streaming by default.
//! - [`model`]: the served model's tokenizer and chat template;
//!   [`TextStream`] emits a growing token sequence's text as it grows.
//! - Process functions at the root: [`args`], [`props`], [`set_prop`],
//!   [`emit`], [`emit_json`], [`receive`], [`log`], [`sleep`], ...
//! - [`bindings`]: the raw generated bindings, for what the API leaves out.
//!
//! A panic traps the process; its message is also sent to the host's log at
//! the error level (and, as usual, to stderr).

/// The raw bindings `wit-bindgen` generates for the `inferlet` world.
pub mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "inferlet",
        generate_all,
        pub_export_macro: true,
        default_bindings_module: "pie_inferlet::bindings",
    });
}

mod context;
mod host;
pub mod model;
mod options;
mod pending;
mod stream;

pub use bindings::pie::inferlet0_1_0::inference::{
    FinishReason, GenerateOptions, Generation, Sampling, TokenLogprob,
};
pub use bindings::pie::inferlet0_1_0::model::Message;
pub use bindings::pie::inferlet0_1_0::process::Level;
pub use bindings::pie::inferlet0_2_0::shaping::LogitShaping;
pub use bindings::pie::inferlet0_2_0::structured::OutputFormat;
pub use bindings::pie::inferlet0_3_0::passes::{Distribution, Report};
pub use context::{Context, generate_all};
pub use host::{
    args, args_json, emit, emit_json, log, now_ms, process_id, props, receive, remove_prop,
    set_prop, sleep, try_receive,
};
pub use options::{GenArgs, Stop, Turn};
pub use pending::{Pending, start_receive, wait_all, wait_any};
pub use serde;
pub use serde_json;
pub use stream::TextStream;

/// Declares the inferlet's entry point: `fn run() -> Result<(), E>` with any
/// `E: Display` (usually `String`). An `Err` fails the process with its text.
///
/// ```ignore
/// fn run() -> Result<(), String> { pie_inferlet::emit("hi") }
/// pie_inferlet::main!(run);
/// ```
#[macro_export]
macro_rules! main {
    ($run:path) => {
        struct __PieInferlet;

        impl $crate::bindings::Guest for __PieInferlet {
            fn run() -> ::core::result::Result<(), ::std::string::String> {
                $crate::__install_panic_hook();
                $run().map_err(|e| ::std::string::ToString::to_string(&e))
            }
        }

        $crate::bindings::export!(__PieInferlet with_types_in $crate::bindings);
    };
}

#[doc(hidden)]
pub fn __install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        log(Level::Error, &info.to_string());
        default(info);
    }));
}

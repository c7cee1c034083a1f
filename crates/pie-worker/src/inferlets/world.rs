//! The `pie:inferlet@0.3.0` world (`wit/0.3.0/inferlet.wit`: the 0.2.0
//! world unchanged, which keeps 0.1.0's interfaces, and `passes` and
//! `steering`) as host bindings, so components built for any of the three
//! versions load, and what else a component may import: the WASI interfaces a
//! Rust `std` guest links (stdio, clocks, random, exit, environment), served
//! with nothing behind them (no directory, no variable, no socket). A leaf.
//!
//! Invariant: a component importing anything outside [`ALLOWED_IMPORTS`] is
//! refused at upload, by name, before it is stored.

use wasmtime::component::Component;
use wasmtime::Engine;

wasmtime::component::bindgen!({
    path: "../../wit/0.3.0",
    world: "inferlet",
    imports: {
        "pie:inferlet/inference": async,
        "pie:inferlet/structured": async,
        "pie:inferlet/process.receive": async,
        "pie:inferlet/process.sleep": async,
        "pie:inferlet/passes.[method]generation-op.subscribe": trappable,
        "pie:inferlet/passes.[method]pass-op.subscribe": trappable,
        "pie:inferlet/passes.[method]message-op.subscribe": trappable,
        "pie:inferlet/model.encode": async,
        "pie:inferlet/model.decode": async,
        "pie:inferlet/model.apply-chat-template": async,
    },
    with: {
        "wasi:io/poll": wasmtime_wasi_io::bindings::wasi::io::poll,
        "pie:inferlet/passes.generation-op": super::ops::GenerationOp,
        "pie:inferlet/passes.pass-op": super::ops::PassOp,
        "pie:inferlet/passes.message-op": super::ops::MessageOp,
    },
    exports: { default: async },
});

pub use pie::inferlet0_1_0::{inference, model, process};
pub use pie::inferlet0_2_0::{reporting, shaping, structured};
pub use pie::inferlet0_3_0::{passes, steering};

/// Interfaces a component may import: this world's, and WASI's harmless
/// ones (matched without their `@version`).
pub const ALLOWED_IMPORTS: &[&str] = &[
    "pie:inferlet/model",
    "pie:inferlet/inference",
    "pie:inferlet/process",
    "pie:inferlet/structured",
    "pie:inferlet/reporting",
    "pie:inferlet/shaping",
    "pie:inferlet/passes",
    "pie:inferlet/steering",
    "wasi:io/error",
    "wasi:io/poll",
    "wasi:io/streams",
    "wasi:clocks/wall-clock",
    "wasi:clocks/monotonic-clock",
    "wasi:random/random",
    "wasi:random/insecure",
    "wasi:random/insecure-seed",
    "wasi:cli/exit",
    "wasi:cli/environment",
    "wasi:cli/stdin",
    "wasi:cli/stdout",
    "wasi:cli/stderr",
    "wasi:cli/terminal-input",
    "wasi:cli/terminal-output",
    "wasi:cli/terminal-stdin",
    "wasi:cli/terminal-stdout",
    "wasi:cli/terminal-stderr",
];

/// The first import outside [`ALLOWED_IMPORTS`], if any; then whether the
/// component exports `run`.
pub fn check_component(engine: &Engine, component: &Component) -> Result<(), String> {
    let ty = component.component_type();
    for (name, _) in ty.imports(engine) {
        let unversioned = name.split('@').next().unwrap_or(name);
        if !ALLOWED_IMPORTS.contains(&unversioned) {
            let ours: Vec<&str> = (ALLOWED_IMPORTS.iter())
                .filter_map(|i| i.strip_prefix("pie:inferlet/"))
                .collect();
            return Err(format!(
                "the component imports `{name}`, which inferlets may not use (they may import \
                 pie:inferlet/{{{}}} and WASI's io, clocks, random and cli)",
                ours.join(",")
            ));
        }
    }
    if !ty.exports(engine).any(|(name, _)| name == "run") {
        return Err(
            "the component exports no `run` function: it is not a pie:inferlet component \
                    (build it with the pie-inferlet SDK)"
                .into(),
        );
    }
    Ok(())
}

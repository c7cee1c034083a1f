//! `tree-of-thought`: a breadth-first tree-of-thought search (Yao et al.,
//! 2023) over the engine's forks. From the prompt, each level expands every
//! kept node into `branches` sibling thoughts of up to `thought_tokens`
//! tokens each: the node's context is forked once per sibling, and all the
//! level's siblings generate at once (`start_generate`), so the engine
//! decodes them in the same steps. Each thought is scored by its mean
//! log-probability under the model; the `keep` best nodes go on to the next
//! level, the rest are dropped (their forks' pages freed). After `depth`
//! levels the best node's thoughts are the answer.
//!
//! Thoughts are sampled (temperature `temperature`, seeded: sibling i of a
//! node at level l draws with `seed + 1000 l + i`, so a run repeats), and a
//! thought ends at a newline, a stop token or `thought_tokens`.
//!
//! Args (any other key is an error): `{"prompt": string, "depth"?: int
//! (default 3, 1 to 8), "branches"?: int (default 4, 1 to 16), "keep"?: int
//! (default 2, 1 to branches), "thought_tokens"?: int (default 24, 1 to
//! 256), "temperature"?: number (default 0.8, 0 to 2), "seed"?: int
//! (default 1), "chat"?: bool (default false)}`.
//!
//! Emits one JSON event `{"thoughts": [string] (the best path, root first),
//! "score": mean log-probability of its thoughts, "expanded": nodes
//! expanded, "generations": thoughts generated}`.

use pie_inferlet::serde_json::json;
use pie_inferlet::{
    Context, GenerateOptions, Generation, Message, Pending, emit_json, model, wait_all,
};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    prompt: String,
    depth: Option<u32>,
    branches: Option<u32>,
    keep: Option<u32>,
    thought_tokens: Option<u32>,
    temperature: Option<f32>,
    seed: Option<u64>,
    #[serde(default)]
    chat: bool,
}

/// The search's shape, checked.
struct Search {
    depth: u32,
    branches: u32,
    keep: usize,
    thought_tokens: u32,
    temperature: f32,
    seed: u64,
}

fn search(args: &Args) -> Result<Search, String> {
    let within = |name: &str, v: Option<u32>, default: u32, max: u32| {
        let v = v.unwrap_or(default);
        match (1..=max).contains(&v) {
            true => Ok(v),
            false => Err(format!("{name} must be 1 to {max}, got {v}")),
        }
    };
    let branches = within("branches", args.branches, 4, 16)?;
    let temperature = args.temperature.unwrap_or(0.8);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(format!("temperature must be 0 to 2, got {temperature}"));
    }
    Ok(Search {
        depth: within("depth", args.depth, 3, 8)?,
        branches,
        keep: within("keep", args.keep, 2, branches)? as usize,
        thought_tokens: within("thought_tokens", args.thought_tokens, 24, 256)?,
        temperature,
        seed: args.seed.unwrap_or(1),
    })
}

/// A node of the tree: its context and the thoughts that led to it.
struct Node {
    ctx: Context,
    thoughts: Vec<String>,
    /// The sum and count of its thoughts' mean log-probabilities.
    score_sum: f32,
}

impl Node {
    fn score(&self) -> f32 {
        match self.thoughts.len() {
            0 => 0.0,
            n => self.score_sum / n as f32,
        }
    }
}

/// Every sibling of one level, forked from its parent, generating at once.
fn expand(level: &[Node], s: &Search, depth: u32) -> Result<Vec<Node>, String> {
    let mut children = Vec::new();
    for parent in level {
        for i in 0..s.branches {
            children.push((parent, parent.ctx.fork()?, i));
        }
    }
    let pending: Vec<Pending<'_, Generation>> = children
        .iter()
        .map(|(_, ctx, i)| {
            let seed = s.seed + 1000 * depth as u64 + *i as u64;
            let options = GenerateOptions::new()
                .max_tokens(s.thought_tokens)
                .temperature(s.temperature)
                .seed(Some(seed))
                .stop(["\n"]);
            ctx.start_generate(&options)
        })
        .collect::<Result<_, _>>()?;
    let generated = wait_all(pending);
    let mut next = Vec::with_capacity(children.len());
    for ((parent, ctx, _), thought) in children.into_iter().zip(generated) {
        let thought = thought?;
        let mut thoughts = parent.thoughts.clone();
        thoughts.push(thought.text.clone());
        next.push(Node {
            ctx,
            thoughts,
            score_sum: parent.score_sum + thought.mean_logprob(),
        });
    }
    Ok(next)
}

/// The `keep` best nodes, best first (ties: the earlier sibling).
fn best(mut nodes: Vec<Node>, keep: usize) -> Vec<Node> {
    nodes.sort_by(|a, b| b.score().total_cmp(&a.score()));
    nodes.truncate(keep);
    nodes
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let s = search(&args)?;
    let root = Context::new()?;
    let text = match args.chat {
        true => model::apply_chat_template(&[Message::user(&args.prompt)])?,
        false => args.prompt.clone(),
    };
    if root.append_text(&text)? == 0 {
        return Err("the prompt must not be empty".into());
    }
    root.prefill()?;
    let mut level = vec![Node {
        ctx: root,
        thoughts: Vec::new(),
        score_sum: 0.0,
    }];
    let (mut expanded, mut generations) = (0, 0);
    for depth in 0..s.depth {
        expanded += level.len();
        let children = expand(&level, &s, depth)?;
        generations += children.len();
        level = best(children, s.keep);
    }
    let top = &level[0];
    emit_json(&json!({
        "thoughts": top.thoughts,
        "score": top.score(),
        "expanded": expanded,
        "generations": generations,
    }))
}

pie_inferlet::main!(run);

#[cfg(test)]
mod tests {
    use super::*;

    fn args(depth: Option<u32>, branches: Option<u32>, keep: Option<u32>) -> Args {
        Args {
            prompt: "x".into(),
            depth,
            branches,
            keep,
            thought_tokens: None,
            temperature: None,
            seed: None,
            chat: false,
        }
    }

    #[test]
    fn the_shape_is_checked_and_keep_never_exceeds_the_branches() {
        let s = search(&args(None, None, None)).unwrap();
        assert_eq!(
            (s.depth, s.branches, s.keep, s.thought_tokens),
            (3, 4, 2, 24)
        );
        assert!(
            search(&args(Some(0), None, None))
                .err()
                .unwrap()
                .contains("depth")
        );
        assert!(
            search(&args(None, Some(3), Some(4)))
                .err()
                .unwrap()
                .contains("keep")
        );
        assert!(
            search(&args(None, Some(17), None))
                .err()
                .unwrap()
                .contains("branches")
        );
    }
}

//! Launching a process: the admission checks (health, drain, the queue
//! limit, the prompt's length and vocabulary, forwarded token ids), the
//! prompt's tokens (a chat session's earlier turns included), and the start
//! of the process's driver.
//!
//! This is where a process's inferlet is chosen: the built-in ones run on
//! [`Driver`] (`builtin.rs`); another kind of inferlet runtime starts its
//! own driver here, beside it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pie_core::Props;
use pie_model::{check_token_ids, ChatMessage};
use pie_policy::Shares;
use pie_workload::TraceInput;

use super::builtin::{Driver, SessionTurn};
use super::offload::PageSource;
use super::request::{GenOptions, Inferlet, LaunchError, Prompt, PromptTokens};
use super::{ProcEvents, Runtime, PROMPT_TOKENS_FIELD, RESUME_FIELD};
use crate::engine::Request;
use crate::process::{ProcState, Process};
use pie_core::clock::now_ms;

impl Runtime {
    /// Start a process; the stream has all its events from the start.
    pub fn launch(
        self: &Arc<Self>,
        inferlet: Inferlet,
        opts: GenOptions,
        props: Props,
        client: String,
        pretokenized: Option<PromptTokens>,
    ) -> Result<(Arc<Process>, ProcEvents), LaunchError> {
        self.admit(&client)?;
        let mut resume = opts.resume.unwrap_or_default();
        let (mut prompt, session_messages) = self.prompt_tokens(
            &inferlet,
            &props,
            &client,
            pretokenized,
            resume.turns.take(),
        )?;
        if prompt.is_empty() {
            return Err(LaunchError::BadRequest("the prompt is empty".into()));
        }
        let prompt_len = prompt.len();
        self.check_vocab(&format!("{RESUME_FIELD}.tokens"), &resume.tokens)?;
        if let Some(grammar) = &opts.grammar {
            grammar.start().advance(&resume.tokens).map_err(|e| {
                LaunchError::BadRequest(format!(
                    "{RESUME_FIELD}.tokens break the response_format constraint: {e}"
                ))
            })?;
        }
        prompt.extend_from_slice(&resume.tokens);
        if prompt.len() >= self.max_seq_tokens {
            return Err(LaunchError::BadRequest(format!(
                "the prompt has {} tokens but a sequence can hold at most {} (prompt and output, KV pool and context length)",
                prompt.len(),
                self.max_seq_tokens
            )));
        }
        let process = self.register_process(inferlet.name(), client, props.clone(), prompt_len);
        if let (Inferlet::Chat { messages, .. }, Some((_, all))) = (&inferlet, &session_messages) {
            let earlier = all.len().saturating_sub(messages.len());
            process.set_earlier_turns(all[..earlier].to_vec());
        }
        let events = process.events();
        let max_tokens =
            (opts.max_tokens.unwrap_or(usize::MAX)).saturating_sub(resume.tokens.len());
        let mut req = Request::new(prompt, max_tokens, process.client.clone(), props, now_ms());
        req.sampling = opts.sampling;
        req.ignore_eos = opts.ignore_eos;
        req.stop_tokens = opts.stop_token_ids;
        req.min_tokens = (opts.text.min_tokens).saturating_sub(resume.tokens.len());
        req.cache_salt = opts.cache_salt;
        req.sampled_before = resume.tokens.len();
        req.logprobs = opts.logprobs;
        req.grammar = opts.grammar;
        let trace_input = self
            .settings
            .trace
            .as_ref()
            .map(|_| TraceInput::of(&req.prompt, req.arrival_ms));
        let driver = Driver {
            rt: self.clone(),
            process: process.clone(),
            text: opts.text,
            session_messages,
            trace_input,
            pages_from: match (opts.prefill_from, resume.from) {
                (Some(url), _) => Some(PageSource { url, prefill: true }),
                (None, Some(url)) => Some(PageSource {
                    url,
                    prefill: false,
                }),
                (None, None) => None,
            },
            generated_before: resume.tokens,
            replay_before: resume.replay,
        };
        tokio::spawn(driver.run(req));
        Ok((process, events))
    }

    /// The checks every launch of `client` passes first: health, drain, the
    /// queue limit and, with several tenants, the client's share of it.
    pub fn admit(&self, client: &str) -> Result<(), LaunchError> {
        self.health().map_err(LaunchError::Unhealthy)?;
        if self.draining() {
            return Err(LaunchError::Draining);
        }
        let queued = self.count_in(ProcState::Queued);
        let max_queued = self.settings.max_queued.load(Ordering::Relaxed);
        if queued >= max_queued {
            self.metrics.count_request("rejected_overload");
            return Err(LaunchError::Overloaded(queued));
        }
        let (mine, clients) = self.state_counts.queued_of(client);
        let active = clients + usize::from(mine == 0);
        if !self.shares_of(max_queued).may_take(mine, queued, active) {
            self.metrics.count_request("rejected_share");
            return Err(LaunchError::OverShare {
                client: client.to_string(),
                queued: mine,
            });
        }
        Ok(())
    }

    /// The per-key shares of a pool of `capacity` places, or none with one
    /// tenant.
    pub fn shares_of(&self, capacity: usize) -> Shares {
        if self.settings.shared.load(Ordering::Relaxed) {
            Shares::of(capacity)
        } else {
            Shares::unshared(capacity)
        }
    }

    /// A new process on record (queued), running `inferlet`.
    pub fn register_process(
        &self,
        inferlet: &str,
        client: String,
        props: Props,
        prompt_tokens: usize,
    ) -> Arc<Process> {
        let id = process_id(self.next_id.fetch_add(1, Ordering::Relaxed));
        let process = Arc::new(Process::new(
            id,
            inferlet,
            client,
            props,
            prompt_tokens,
            self.state_counts.clone(),
        ));
        self.lock_processes().insert(process.clone());
        process
    }

    /// The prompt's tokens and, for a resumed chat session, the messages to record.
    /// A session belongs to its client: another client naming the same session
    /// starts its own. `pretokenized` ids (checked: this model's fingerprint,
    /// every id in the vocabulary) replace tokenizing a text prompt or a chat
    /// without earlier turns on this worker; a session with earlier turns is
    /// tokenized here (the controller cannot know them), and a token-id prompt
    /// is used as sent. `turns` (a resumed session's, from its first worker)
    /// replace the session's earlier turns here.
    fn prompt_tokens(
        &self,
        inferlet: &Inferlet,
        props: &Props,
        client: &str,
        pretokenized: Option<PromptTokens>,
        turns: Option<Vec<ChatMessage>>,
    ) -> Result<(Vec<u32>, Option<SessionTurn>), LaunchError> {
        let bad = |e: anyhow::Error| LaunchError::BadRequest(e.to_string());
        let mut pretokenized = match pretokenized {
            Some(p) => Some(self.checked_prompt_tokens(p)?),
            None => None,
        };
        match inferlet {
            Inferlet::TextCompletion {
                prompt: Prompt::Text(text),
            } => Ok((
                self.ids_or(pretokenized, || {
                    self.model.tokenizer.encode(text).map_err(bad)
                })?,
                None,
            )),
            Inferlet::TextCompletion {
                prompt: Prompt::Tokens(ids),
            } => {
                self.check_vocab("prompt", ids)?;
                Ok((ids.clone(), None))
            }
            Inferlet::Chat {
                messages,
                resume_session,
                tools,
                ending,
            } => {
                let session = props
                    .str("session")
                    .filter(|_| *resume_session)
                    .map(|s| session_key(client, s));
                let mut all = match (session.as_deref(), turns) {
                    (Some(_), Some(turns)) => turns,
                    (Some(s), None) => self.lock_sessions().get(s).unwrap_or_default(),
                    (None, _) => Vec::new(),
                };
                if !all.is_empty() {
                    // Earlier turns the controller did not see: the ids lack them.
                    pretokenized = None;
                }
                all.extend(messages.iter().cloned());
                let tokenize = || {
                    let text = self
                        .model
                        .tokenizer
                        .apply_chat_template_ending(&all, tools.as_ref(), *ending)
                        .map_err(bad)?;
                    self.model.tokenizer.encode(&text).map_err(bad)
                };
                let ids = self.ids_or(pretokenized, tokenize)?;
                Ok((ids, session.map(|s| (s, all))))
            }
        }
    }

    /// The forwarded ids (counted), or the prompt tokenized here.
    fn ids_or(
        &self,
        pretokenized: Option<Vec<u32>>,
        tokenize: impl FnOnce() -> Result<Vec<u32>, LaunchError>,
    ) -> Result<Vec<u32>, LaunchError> {
        match pretokenized {
            Some(ids) => {
                self.metrics.pretokenized.inc();
                Ok(ids)
            }
            None => tokenize(),
        }
    }

    /// Forwarded ids if they are this model's: its fingerprint, its vocabulary.
    fn checked_prompt_tokens(&self, p: PromptTokens) -> Result<Vec<u32>, LaunchError> {
        let ours = self.shape.fingerprint;
        if p.fingerprint != ours {
            return Err(LaunchError::BadRequest(format!(
                "{PROMPT_TOKENS_FIELD}.fingerprint {:#018x} is not this worker's model ({ours:#018x})",
                p.fingerprint
            )));
        }
        self.check_vocab(&format!("{PROMPT_TOKENS_FIELD}.ids"), &p.ids)?;
        Ok(p.ids)
    }

    /// Every id below the vocabulary size, or a 400 naming `what`.
    pub(super) fn check_vocab(&self, what: &str, ids: &[u32]) -> Result<(), LaunchError> {
        check_token_ids(ids, self.model.config.vocab)
            .map_err(|e| LaunchError::BadRequest(format!("{what} {e}")))
    }
}

/// A process id: the launch number (fixed-width hex, so ids sort in launch
/// order) and 64 random bits, so that no client can guess another's id.
fn process_id(number: u64) -> String {
    format!("proc-{number:012x}{:016x}", rand::random::<u64>())
}

/// Where a client's chat session is kept: length-prefixed, so no pair of client
/// and session names can spell another pair's key.
fn session_key(client: &str, session: &str) -> String {
    pie_policy::keep_session::retention_key(client, session)
}

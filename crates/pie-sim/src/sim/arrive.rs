//! Arrivals: a request is hashed (reusing known prefixes), routed by the
//! real cluster policies, and queued on its worker (or its prefill worker);
//! rejections, follow-up turns and the router's prefix index live here too.

use pie_core::{block_hash, block_hashes, BlockHash, SeqId};
use pie_policy::keep_session::session_of;
use pie_policy::{Candidate, Planned, Scheduler};

use crate::events::Event;
use crate::pages::{PageModel, Seq, SLOT_BITS};

use super::{Sim, FINGERPRINT, MEMO_CAPACITY};

impl Sim<'_> {
    pub(super) fn arrive(&mut self, r: usize, now: u64) -> anyhow::Result<()> {
        let reqs = self.reqs;
        let req = &reqs[r];
        let ps = self.cfg.profile.page_size;
        self.records[r].arrival_us = now;
        let limit = self.cfg.profile.kv_pages * ps;
        let prompt_len = req.prompt_len();
        if prompt_len == 0 || prompt_len >= limit {
            self.reject(r, now);
            return Ok(());
        }
        let max_tokens = req.output_len().min(limit - prompt_len).max(1);
        let hashes = self.hashes(r, prompt_len + max_tokens);
        let usable = hashes.len().min((prompt_len - 1) / ps);
        if let Some(heat) = &mut self.heat {
            heat.record(&hashes[..usable], now / 1000);
        }
        if let (Some(pool), true) = (&self.pool, self.router.tracks_prefixes()) {
            self.router.set_pooled(pool.leading(&hashes[..usable]));
        }
        let routed = self
            .router
            .route(now / 1000, &req.props, prompt_len, &hashes[..usable]);
        let Ok(routed) = routed else {
            self.reject(r, now);
            return Ok(());
        };
        let decode = routed.decode;
        let client = self.client_id(&req.client);
        let seq = Seq {
            hashes,
            prompt_len: prompt_len as u32,
            max_tokens: max_tokens as u32,
            generated: 0,
            len: 0,
            pages: 0,
            published: 0,
            client,
            req: r as u32,
            window_tokens: 0,
            last_token_us: 0,
            handoff: routed.prefill.map(|_| decode as u32),
            resume: session_of(&req.client, &req.props),
        };
        self.records[r].worker = decode as u32;
        self.records[r].prompt_tokens = prompt_len as u32;
        // The decode worker has the request from now on, as the controller
        // counts it; a prefill worker only while it prefills.
        self.router.set_load(decode, self.router.load(decode) + 1);
        let Some(p) = routed.prefill else {
            return self.pull_then_admit(decode, seq, now);
        };
        self.records[r].prefill_worker = Some(p as u32);
        let t = &mut self.counters.transfers;
        let uncached = routed.uncached_tokens as u64;
        t.min_remote_uncached_tokens = match t.remote_prefills {
            0 => uncached,
            _ => t.min_remote_uncached_tokens.min(uncached),
        };
        t.remote_prefills += 1;
        self.router.set_load(p, self.router.load(p) + 1);
        self.pull_then_admit(p, seq, now)
    }

    /// Queue `seq` on worker `w`'s scheduler (a new arrival, or a prefilled
    /// request reaching its decode worker) and wake the worker if idle.
    pub(super) fn admit(&mut self, w: usize, seq: Seq, now: u64) -> anyhow::Result<()> {
        let r = seq.req as usize;
        let prefill_tokens = seq.prompt_len as usize;
        let slot = self.workers[w].pages.insert(seq).ok_or_else(|| {
            anyhow::anyhow!("more than 2^{SLOT_BITS} live sequences on worker {w}")
        })?;
        self.arrivals += 1;
        let req = &self.reqs[r];
        let candidate = Candidate {
            seq: SeqId(self.arrivals << SLOT_BITS | slot as u64),
            arrival_ms: self.records[r].arrival_us / 1000,
            running: false,
            prefill_tokens,
            client: req.client.clone(),
            props: req.props.clone(),
        };
        let (scheduler, kv, _) = self.split(w);
        scheduler.add(&kv, candidate);
        if let Some(log) = &mut self.log {
            log.admissions.push((r, log.steps.len()));
        }
        if self.workers[w].step_end.is_none() {
            if self.events.next_at() == Some(now) {
                // Wake it once every arrival at this instant is in, as the
                // engine takes all queued requests before it plans a step.
                self.set_step_end(w, now);
            } else {
                self.start_step(w, now)?;
            }
        }
        Ok(())
    }

    /// A dense id per client name (allocating only for a new client).
    pub(super) fn client_id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.client_ids.get(name) {
            return id;
        }
        let id = self.client_ids.len() as u32;
        self.client_ids.insert(name.to_string(), id);
        id
    }

    /// A worker's scheduler, its pages as the scheduler sees them, and its step.
    pub(super) fn split(&mut self, w: usize) -> (&mut Scheduler, PageModel<'_>, &mut Vec<Planned>) {
        let worker = &mut self.workers[w];
        let kv = PageModel {
            pages: &mut worker.pages,
            records: &mut self.records,
            prefix_hit_tokens: &mut self.counters.prefix_hit_tokens,
        };
        (&mut worker.scheduler, kv, &mut worker.plan)
    }

    /// Refused: too long for a worker's pool, or by a cluster policy.
    pub(super) fn reject(&mut self, r: usize, now: u64) {
        self.records[r].rejected = true;
        self.records[r].finish_us = Some(now);
        self.counters.rejected += 1;
        self.follow_up(r, now);
    }

    /// `pie_core::block_hashes` of request `r`'s first `total` tokens, hashing
    /// only past a known prefix of whole pages: the hashes of the turn it
    /// continues, or of a first segment made of whole pages (a shared system
    /// prompt).
    pub(super) fn hashes(&mut self, r: usize, total: usize) -> Vec<BlockHash> {
        let ps = self.cfg.profile.page_size;
        let mut hashes = self.known_prefix(r, total);
        hashes.reserve(total / ps - hashes.len());
        self.tokens.clear();
        self.reqs[r].push_token_range(hashes.len() * ps, total, &mut self.tokens);
        let mut parent = hashes.last().copied().unwrap_or(FINGERPRINT.root());
        for page in self.tokens.chunks_exact(ps) {
            parent = block_hash(parent, page);
            hashes.push(parent);
        }
        hashes
    }

    /// Hashes of whole pages at the start of request `r`'s first `total` tokens
    /// known without hashing them.
    pub(super) fn known_prefix(&mut self, r: usize, total: usize) -> Vec<BlockHash> {
        let ps = self.cfg.profile.page_size;
        if let Some(mut carried) = self.carried[r].take() {
            carried.truncate(total / ps);
            return carried;
        }
        let first = self.reqs[r].prompt[0];
        let len = first.len as usize;
        if len == 0 || !len.is_multiple_of(ps) || len > total {
            return Vec::new();
        }
        if self.memo.len() >= MEMO_CAPACITY {
            self.memo.clear();
        }
        let tokens = &mut self.tokens;
        self.memo
            .entry((first.key, first.len))
            .or_insert_with(|| {
                tokens.clear();
                first.push_tokens(tokens);
                block_hashes(FINGERPRINT, tokens, ps)
            })
            .clone()
    }

    pub(super) fn follow_up(&mut self, r: usize, now: u64) {
        if let Some(next) = self.followers[r] {
            let think = self.reqs[next as usize].follows.map_or(0, |f| f.think_us);
            self.events.push(now + think, Event::Arrive(next));
        }
    }

    pub(super) fn sync_index(&mut self, w: usize) {
        if self.router.tracks_prefixes() {
            let log = self.workers[w].pages.cache.drain_log();
            self.router.cache_changed(w, &log);
        }
    }
}

#[cfg(test)]
mod tests {
    use pie_core::block_hashes;

    use super::*;
    use crate::config::{PolicyName, SimConfig};
    use crate::cost::CostProfile;
    use crate::workload::WorkloadSpec;

    #[test]
    fn reused_hashes_equal_block_hashes_of_the_tokens() {
        let cfg = SimConfig::new(
            1,
            PolicyName::Fcfs,
            "round-robin".parse().expect("built-in router"),
            CostProfile::cpu_placeholder(),
        );
        for name in ["shared-prefix", "multi-turn", "deadline-mix"] {
            let reqs = WorkloadSpec::named(name).unwrap().generate(20, 1);
            let policy = || cfg.policy.build();
            let mut sim = Sim::new(&cfg, &reqs, &policy);
            let mut tokens = Vec::new();
            let mut carried = 0;
            for (i, r) in reqs.iter().enumerate() {
                let total = r.prompt_len() + r.output_len() - 3;
                r.tokens(&mut tokens);
                tokens.truncate(total);
                let want = block_hashes(FINGERPRINT, &tokens, 16);
                carried += usize::from(sim.carried[i].is_some());
                assert_eq!(sim.hashes(i, total), want, "{name}");
                // Twice: the second comes from the memo, not the carried turn.
                assert_eq!(sim.hashes(i, total), want, "{name}");
                // As `finish` leaves them for the next turn.
                if let Some(n) = sim.followers[i].map(|n| n as usize) {
                    if reqs[n].continues(r) {
                        let all = sim.hashes(i, r.prompt_len() + r.output_len());
                        sim.carried[n] = Some(all);
                    }
                }
            }
            assert!(!sim.memo.is_empty() || name == "deadline-mix");
            assert_eq!(carried > 0, name == "multi-turn", "{name}: {carried}");
        }
    }
}

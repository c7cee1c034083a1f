//! The table of movable streams and native processes in flight: where each
//! runs now, the channel its moves arrive on, and, for the ones that moved,
//! where they ended (kept for the id the client holds). The relay and the
//! native follower keep it current; the actors, relocations and PATCHes read
//! it and ask for moves through it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::{mpsc, Notify};

use crate::metrics::MoveLabels;

/// Where a stream starts, as the table records it.
pub struct Placement {
    pub worker: String,
    pub session: Option<String>,
    /// Its id in the actors' snapshot (`request-N`), when actors run.
    pub process: Option<String>,
}

/// Why a stream moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Drain,
    Relocate,
    Rebalance,
    Crash,
}

impl Reason {
    pub fn label(self) -> MoveLabels {
        MoveLabels {
            reason: match self {
                Reason::Drain => "drain",
                Reason::Relocate => "relocate",
                Reason::Rebalance => "rebalance",
                Reason::Crash => "crash",
            },
        }
    }
}

/// A request to move one stream to worker `to`.
#[derive(Clone, Debug)]
pub struct Move {
    pub to: String,
    pub reason: Reason,
}

/// The movable streams and native processes in flight, by the
/// controller's number for them, and where the ones that moved ended.
#[derive(Default)]
pub struct Streams {
    next: AtomicU64,
    live: Mutex<Table>,
    ended: Mutex<Ended>,
    /// Woken whenever a stream's whereabouts change (it named its process
    /// on a worker, or ended), so a reader waiting for a move need not poll.
    changed: Notify,
}

/// The streams in flight, and each one's number by the id its client holds.
#[derive(Default)]
struct Table {
    live: HashMap<u64, Live>,
    by_origin: HashMap<(String, String), u64>,
}

impl Table {
    fn by_origin(&mut self, worker: &str, local: &str) -> Option<&mut Live> {
        let id = self
            .by_origin
            .get(&(worker.to_string(), local.to_string()))?;
        self.live.get_mut(id)
    }
}

/// Where a process that moved ended up, by the id its client holds; the
/// newest `ENDED_KEPT` (a client reads a finished process's record later).
#[derive(Default)]
struct Ended {
    at: HashMap<(String, String), Whereabouts>,
    order: VecDeque<(String, String)>,
}

/// Processes that moved whose whereabouts are kept after they end.
const ENDED_KEPT: usize = 65_536;

/// Where the process a client knows by its first worker and id is now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Whereabouts {
    At {
        worker: String,
        local: String,
        /// A native process: its record on `worker` holds its whole output
        /// (see `native`), so its events line up with the first worker's.
        replays: bool,
    },
    /// It could not go on anywhere: why.
    Lost(String),
}

struct Live {
    worker: String,
    session: Option<String>,
    /// Its id in the actors' snapshot (`request-N`), when actors run.
    process: Option<String>,
    moves: mpsc::UnboundedSender<Move>,
    /// The first worker and the process id it named: the id the client
    /// holds (`WORKER~ID`, its chunks' `id`), valid across moves.
    origin: Option<(String, String)>,
    /// Its process id on `worker`.
    local: Option<String>,
    /// Its props as last changed (a PATCH through the controller, or the
    /// process's own props event): the workers it moves to get these.
    props: Option<Value>,
    /// A native process (see [`Whereabouts::At`]).
    replays: bool,
    /// Why it does not move, if it does not (a WebAssembly inferlet's
    /// process: its state is in its guest's memory).
    stays: Option<String>,
}

impl Streams {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Register a placed stream (or a native process: `replays`); its
    /// moves arrive on the receiver.
    pub fn add(&self, placed: Placement, replays: bool) -> (u64, mpsc::UnboundedReceiver<Move>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (moves, rx) = mpsc::unbounded_channel();
        let live = Live {
            worker: placed.worker,
            session: placed.session,
            process: placed.process,
            moves,
            origin: None,
            local: None,
            props: None,
            replays,
            stays: None,
        };
        self.lock().live.insert(id, live);
        (id, rx)
    }

    /// Stream `id` does not move, for `why` (moves asked of it fail, naming it).
    pub fn stays(&self, id: u64, why: &str) {
        if let Some(l) = self.lock().live.get_mut(&id) {
            l.stays = Some(why.to_string());
        }
    }

    /// Stream `id` moved to `worker` (which names its process next).
    pub fn now_on(&self, id: u64, worker: &str) {
        if let Some(l) = self.lock().live.get_mut(&id) {
            l.worker = worker.to_string();
            l.local = None;
        }
    }

    /// Stream `id` ended; `lost` says why when it could not go on. Where a
    /// stream that moved (or was lost) ended is kept for its id.
    pub fn remove(&self, id: u64, lost: Option<String>) {
        let mut table = self.lock();
        let Some(l) = table.live.remove(&id) else {
            return;
        };
        let Some(origin) = l.origin else { return };
        table.by_origin.remove(&origin);
        drop(table);
        let at = match (lost, l.local) {
            (Some(why), _) => Whereabouts::Lost(why),
            (None, Some(local)) if (&l.worker, &local) != (&origin.0, &origin.1) => {
                Whereabouts::At {
                    worker: l.worker,
                    local,
                    replays: l.replays,
                }
            }
            _ => return,
        };
        let mut ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        if ended.at.insert(origin.clone(), at).is_none() {
            ended.order.push_back(origin);
        }
        if ended.order.len() > ENDED_KEPT {
            if let Some(oldest) = ended.order.pop_front() {
                ended.at.remove(&oldest);
            }
        }
        drop(ended);
        self.changed.notify_waiters();
    }

    /// Stream `id`'s worker named its process `local`.
    pub fn named(&self, id: u64, local: &str) {
        let mut table = self.lock();
        let Some(l) = table.live.get_mut(&id) else {
            return;
        };
        l.local = Some(local.to_string());
        if l.origin.is_none() {
            let origin = (l.worker.clone(), local.to_string());
            l.origin = Some(origin.clone());
            table.by_origin.insert(origin, id);
        }
        drop(table);
        self.changed.notify_waiters();
    }

    /// Wait until `look` finds something (Some) or `limit` passes (None),
    /// looking again whenever a stream's whereabouts change.
    pub(crate) async fn wait_for<T>(
        &self,
        limit: Duration,
        mut look: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before looking, so a change in between still wakes it.
            changed.as_mut().enable();
            if let Some(found) = look() {
                return Some(found);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return None;
            }
        }
    }

    /// Stream `id`'s process set its own props (an inferlet's `set-prop`, a
    /// PATCH to its worker): the workers it moves to get these.
    pub fn set_props(&self, id: u64, props: &Value) {
        if let Some(l) = self.lock().live.get_mut(&id) {
            l.props = Some(props.clone());
        }
    }

    pub fn props_of(&self, id: u64) -> Option<Value> {
        self.lock().live.get(&id).and_then(|l| l.props.clone())
    }

    /// Where the stream the client knows as `worker~local` runs now, or
    /// ended after moving (None: neither, or between two workers).
    pub fn current(&self, worker: &str, local: &str) -> Option<Whereabouts> {
        if let Some(l) = self.lock().by_origin(worker, local) {
            return Some(Whereabouts::At {
                worker: l.worker.clone(),
                local: l.local.clone()?,
                replays: l.replays,
            });
        }
        let ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended
            .at
            .get(&(worker.to_string(), local.to_string()))
            .cloned()
    }

    /// The stream the client knows as `worker~local` has the props `props`
    /// now (a PATCH): the workers it moves to get them, and when its `pin`
    /// names a worker it is not on that `serves`, it moves there (a
    /// relocation). Returns that worker.
    pub fn patched(
        &self,
        worker: &str,
        local: &str,
        props: &Value,
        serves: impl Fn(&str) -> bool,
    ) -> Option<String> {
        let mut table = self.lock();
        let l = table.by_origin(worker, local)?;
        l.props = Some(props.clone());
        let pin = props["pin"]
            .as_str()
            .filter(|&pin| pin != l.worker && serves(pin))?;
        let asked = Move {
            to: pin.to_string(),
            reason: Reason::Relocate,
        };
        l.moves.send(asked).ok().map(|()| pin.to_string())
    }

    /// Ask the streams of `session` to move to `to`; returns how many.
    pub fn move_session(&self, session: &str, to: &str) -> usize {
        self.ask(
            |l| l.session.as_deref() == Some(session) && l.worker != to,
            to,
            Reason::Relocate,
        )
    }

    /// Ask the stream of the actors' process `process` to move to `to`;
    /// why not, when no such stream is in flight or it does not move.
    pub fn move_process(&self, process: &str, to: &str, reason: Reason) -> Result<(), String> {
        let stays = (self.lock().live.values())
            .find(|l| l.process.as_deref() == Some(process))
            .and_then(|l| l.stays.clone());
        if let Some(why) = stays {
            return Err(format!("`{process}` stays where it is: {why}"));
        }
        let asked = self.ask(
            |l| l.process.as_deref() == Some(process) && l.worker != to,
            to,
            reason,
        );
        match asked {
            0 => Err(format!(
                "`{process}` is not a movable stream in flight (only streamed OpenAI requests and \
                 native processes move)"
            )),
            _ => Ok(()),
        }
    }

    fn ask(&self, which: impl Fn(&Live) -> bool, to: &str, reason: Reason) -> usize {
        self.lock()
            .live
            .values()
            .filter(|l| l.stays.is_none() && which(l))
            .filter(|l| {
                l.moves
                    .send(Move {
                        to: to.to_string(),
                        reason,
                    })
                    .is_ok()
            })
            .count()
    }
}

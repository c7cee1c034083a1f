//! Requests in flight per client across the whole cluster: with the waiting
//! ones, the clients that have work (`queue_order = "fair"` lifts a client
//! that gets work to the others' service). A client's entry exists only
//! while it has requests in flight, so the map is bounded by them.

use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Default)]
pub struct ClientsInFlight(Mutex<HashMap<String, usize>>);

impl ClientsInFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn started(&self, client: &str) {
        *self.lock().entry(client.to_string()).or_default() += 1;
    }

    pub fn finished(&self, client: &str) {
        let mut map = self.lock();
        if let Some(n) = map.get_mut(client) {
            *n -= 1;
            if *n == 0 {
                map.remove(client);
            }
        }
    }

    pub fn count(&self, client: &str) -> usize {
        self.lock().get(client).copied().unwrap_or(0)
    }

    /// Clients with requests in flight.
    pub fn clients(&self) -> usize {
        self.lock().len()
    }

    /// Who has requests in flight.
    pub fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_live_only_while_requests_are_in_flight() {
        let c = ClientsInFlight::default();
        c.started("a");
        c.started("a");
        c.started("b");
        assert_eq!((c.count("a"), c.count("b"), c.clients()), (2, 1, 2));
        c.finished("a");
        c.finished("b");
        assert_eq!((c.count("a"), c.count("b"), c.clients()), (1, 0, 1));
        assert_eq!(c.names(), ["a"]);
        c.finished("a");
        assert_eq!(c.clients(), 0);
    }
}

//! What a sink learned of each destination by asking the service (an SQS
//! queue's `MaximumMessageSize`, whether an EventBridge bus exists), kept for
//! a while so that a batch rarely waits for it and a change on the service is
//! still seen.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a fact a service gave is used before it is asked again: a change
/// on the service (a queue's limit raised, a bus deleted) is seen within it.
pub const KNOWN_FOR: Duration = Duration::from_secs(60);
/// How long a stand-in is used when the service did not answer, so that an
/// outage does not make every batch ask again, one at a time.
pub const UNANSWERED_FOR: Duration = Duration::from_secs(10);

/// Per destination: a fact and until when it holds.
pub struct Known<T> {
    facts: Mutex<HashMap<Arc<str>, (T, Instant)>>,
    /// Held while a destination is asked about: one ask at a time, and
    /// batches that start meanwhile wait for its answer.
    asking: tokio::sync::Mutex<()>,
}

impl<T: Clone> Default for Known<T> {
    fn default() -> Self {
        Self {
            facts: Mutex::new(HashMap::new()),
            asking: tokio::sync::Mutex::new(()),
        }
    }
}

impl<T: Clone> Known<T> {
    /// `destination`'s fact: the one learned if it still holds, else what
    /// `ask` answers now, kept for the duration it returns with it. `ask` is
    /// given the fact it replaces (expired), if any, so that a lasting
    /// problem is said when it starts, not at every ask.
    pub async fn get<F, Fut>(&self, destination: &Arc<str>, ask: F) -> T
    where
        F: FnOnce(Option<T>) -> Fut,
        Fut: Future<Output = (T, Duration)>,
    {
        if let Some(fact) = self.fresh(destination) {
            return fact;
        }
        let _asking = self.asking.lock().await;
        if let Some(fact) = self.fresh(destination) {
            return fact;
        }
        let before = self.lock().get(destination).map(|(fact, _)| fact.clone());
        let (fact, valid) = ask(before).await;
        self.lock().insert(
            Arc::clone(destination),
            (fact.clone(), Instant::now() + valid),
        );
        fact
    }

    fn fresh(&self, destination: &str) -> Option<T> {
        self.lock()
            .get(destination)
            .filter(|(_, until)| *until > Instant::now())
            .map(|(fact, _)| fact.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, (T, Instant)>> {
        self.facts.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_fact_is_asked_once_while_it_holds_and_again_after() {
        let known = Known::default();
        let asked = std::sync::atomic::AtomicUsize::new(0);
        // The fact: which ask it was, and which fact it replaced.
        let ask = |valid: Duration| {
            let asked = &asked;
            move |before: Option<(usize, Option<usize>)>| async move {
                let n = asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                ((n, before.map(|(m, _)| m)), valid)
            }
        };
        let queue: Arc<str> = Arc::from("q");
        assert_eq!(
            known.get(&queue, ask(Duration::from_secs(60))).await,
            (0, None)
        );
        assert_eq!(
            known.get(&queue, ask(Duration::from_secs(60))).await,
            (0, None),
            "held"
        );
        let other: Arc<str> = Arc::from("r");
        assert_eq!(known.get(&other, ask(Duration::ZERO)).await, (1, None));
        assert_eq!(
            known.get(&other, ask(Duration::ZERO)).await,
            (2, Some(1)),
            "expired: asked again, given the fact it replaces"
        );
    }
}

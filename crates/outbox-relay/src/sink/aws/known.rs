//! What a sink learned of each destination by asking the service (an SQS
//! queue's or SNS topic's `MaximumMessageSize`, whether an EventBridge bus
//! exists), kept for a while so that a batch rarely waits for it and a change
//! on the service is still seen.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a fact a service gave is used before it is asked again: a change
/// on the service (a queue's limit raised, a bus deleted) is seen within it.
pub(crate) const KNOWN_FOR: Duration = Duration::from_secs(60);
/// How long a stand-in is used when the service did not answer, so that an
/// outage does not make every batch ask again, one at a time.
pub(crate) const UNANSWERED_FOR: Duration = Duration::from_secs(10);

/// How long a fact is used that only a sign from the service ends
/// ([`Known::forget_if`]): an SNS topic's limit, learned again when SNS
/// refuses what it let through. For a process, forever (yet an `Instant`
/// can still be this far ahead).
pub(crate) const UNTIL_FORGOTTEN: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Warn that a destination's `MaximumMessageSize` may not be read, in the
/// one wording every gate uses: the permission to grant, the key that makes
/// asking unnecessary, and the size assumed meanwhile. The destination goes
/// in the log field the gate names (`topic`, `queue`), so both keep their
/// fields.
macro_rules! warn_unreadable_limit {
    ($field:ident = $destination:expr, $reason:expr, $what:literal, $permission:literal, $key:literal, $assumed:expr) => {
        tracing::warn!(
            $field = %$destination,
            error = %$reason,
            concat!(
                "cannot read the ", $what, "'s MaximumMessageSize (allow ", $permission,
                ", or set ", $key, "); assuming {} bytes"
            ),
            $assumed
        )
    };
}
pub(crate) use warn_unreadable_limit;

/// Most destinations a sink remembers facts of. A row may name any
/// destination its sink allows (`crate::config::allow`), so an application can
/// name very many: past this the facts that expired go, and if that is not
/// enough all of them (each is asked again when next needed), so memory stays
/// bounded (DESIGN.md invariant 6). As many as the router's cache of names.
pub(crate) const MAX_KNOWN: usize = 10_000;

/// Per destination: a fact and until when it holds.
pub(crate) struct Known<T> {
    facts: Mutex<HashMap<Arc<str>, (T, Instant)>>,
    /// Per destination, held while it is asked about: one ask at a time
    /// for it, and its batches that start meanwhile wait for the answer;
    /// other destinations' batches do not.
    asking: Mutex<HashMap<Arc<str>, Arc<tokio::sync::Mutex<()>>>>,
}

impl<T: Clone> Default for Known<T> {
    fn default() -> Self {
        Self {
            facts: Mutex::new(HashMap::new()),
            asking: Mutex::new(HashMap::new()),
        }
    }
}

impl<T: Clone> Known<T> {
    /// `destination`'s fact: the one learned if it still holds, else what
    /// `ask` answers now, kept for the duration it returns with it. `ask` is
    /// given the fact it replaces (expired), if any, so that a lasting
    /// problem is said when it starts, not at every ask.
    pub(crate) async fn get<F, Fut>(&self, destination: &Arc<str>, ask: F) -> T
    where
        F: FnOnce(Option<T>) -> Fut,
        Fut: Future<Output = (T, Duration)>,
    {
        if let Some(fact) = self.fresh(destination) {
            return fact;
        }
        let asking = Arc::clone(
            self.asking
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(Arc::clone(destination))
                .or_default(),
        );
        let _asking = asking.lock().await;
        if let Some(fact) = self.fresh(destination) {
            return fact;
        }
        let before = self.lock().get(destination).map(|(fact, _)| fact.clone());
        let (fact, valid) = ask(before).await;
        let now = Instant::now();
        {
            let mut facts = self.lock();
            if facts.len() >= MAX_KNOWN && !facts.contains_key(destination) {
                facts.retain(|_, (_, until)| *until > now);
                if facts.len() >= MAX_KNOWN {
                    facts.clear();
                }
            }
            facts.insert(Arc::clone(destination), (fact.clone(), now + valid));
        }
        drop(_asking);
        let mut asking = self.asking.lock().unwrap_or_else(PoisonError::into_inner);
        if asking.len() > MAX_KNOWN {
            // Only the destinations someone is asking about now.
            asking.retain(|_, held| Arc::strong_count(held) > 1);
        }
        fact
    }

    /// Forget `destination`'s fact if `stale` says so of it (it is asked
    /// again when next needed); whether it was forgotten.
    pub(crate) fn forget_if(&self, destination: &str, stale: impl FnOnce(&T) -> bool) -> bool {
        let mut facts = self.lock();
        let forget = facts.get(destination).is_some_and(|(fact, _)| stale(fact));
        if forget {
            facts.remove(destination);
        }
        forget
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
    async fn facts_of_ever_more_destinations_stay_bounded() {
        let known = Known::default();
        for n in 0..(MAX_KNOWN * 2 + 10) {
            let destination: Arc<str> = Arc::from(format!("bus-{n}"));
            let fact = known
                .get(&destination, |_| async { (n, Duration::from_secs(60)) })
                .await;
            assert_eq!(fact, n);
        }
        assert!(known.lock().len() <= MAX_KNOWN);
        assert!(known.asking.lock().unwrap().len() <= MAX_KNOWN + 1);
        // What is kept is still used.
        let last: Arc<str> = Arc::from(format!("bus-{}", MAX_KNOWN * 2 + 9));
        let fact = known
            .get(&last, |_| async { (0, Duration::from_secs(60)) })
            .await;
        assert_eq!(fact, MAX_KNOWN * 2 + 9);
    }

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

    #[tokio::test]
    async fn a_fact_held_until_forgotten_is_asked_again_once_forgotten() {
        let known = Known::default();
        let topic: Arc<str> = Arc::from("t");
        let ask = |n: usize| move |_| async move { (n, UNTIL_FORGOTTEN) };
        assert_eq!(known.get(&topic, ask(1)).await, 1);
        assert_eq!(known.get(&topic, ask(2)).await, 1, "held");
        assert!(!known.forget_if(&topic, |n| *n == 2), "not stale");
        assert_eq!(known.get(&topic, ask(3)).await, 1);
        assert!(known.forget_if(&topic, |n| *n == 1));
        assert!(!known.forget_if(&topic, |_| true), "already forgotten");
        assert_eq!(known.get(&topic, ask(4)).await, 4, "asked again");
    }

    #[tokio::test]
    async fn a_destination_waits_only_for_its_own_ask() {
        let known: Known<&str> = Known::default();
        let (slow, fast): (Arc<str>, Arc<str>) = (Arc::from("slow"), Arc::from("fast"));
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let slow_ask = known.get(&slow, |_| async move {
            let _ = released.await;
            ("slow", KNOWN_FOR)
        });
        let fast_ask = known.get(&fast, |_| async { ("fast", KNOWN_FOR) });
        tokio::pin!(slow_ask);
        // The slow ask is under way (holding its destination) ...
        assert!(futures_now(&mut slow_ask).await.is_none());
        // ... and the other destination is answered meanwhile.
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(5), fast_ask).await,
            Ok("fast")
        );
        release.send(()).unwrap();
        assert_eq!(slow_ask.await, "slow");
    }

    /// Polls `future` once: its output if it is ready.
    async fn futures_now<F: Future + Unpin>(future: &mut F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut *future).poll(cx) {
                std::task::Poll::Ready(output) => Some(output),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}

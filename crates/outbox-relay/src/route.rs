//! Routing: which destination (topic, queue, bus, stream, URL) an event goes to.
//!
//! In order of precedence:
//! 1. the row's own destination (`columns.topic`), a full name or a bare one
//!    the sink expands (SNS: a topic name becomes an ARN of the configured
//!    region and account);
//! 2. the sink's template, e.g. `arn:aws:sns:{region}:{account}:{aggregate_type}`;
//! 3. the sink's default destination.
//!
//! What the names mean is the sink's: each destination's settings describe
//! their rules as [`Routes`] (`crate::sink::Settings::routes`). A route that
//! names no existing destination is not an error here: the destination
//! answers that it does not exist, and the sink rejects the event (recorded as
//! failed).

use std::collections::HashMap;
use std::sync::Arc;

use crate::event::OutboxEvent;
pub use crate::sink::settings::{check_template, Routes};

/// Computes each event's destination.
#[derive(Debug, Clone)]
pub struct Router {
    routes: Routes,
    default: Option<Arc<str>>,
    /// Rendered destinations, so each distinct one is allocated once.
    cache: HashMap<String, Arc<str>>,
}

/// A destination for sinks that have only one (stdout).
pub fn nowhere() -> Arc<str> {
    Arc::from("")
}

impl Router {
    /// A router following `routes`.
    pub fn new(routes: Routes) -> Self {
        Self {
            default: routes.default.as_deref().map(Arc::from),
            routes,
            cache: HashMap::new(),
        }
    }

    /// The event's destination, or why it has none.
    pub fn route(&mut self, event: &OutboxEvent) -> Result<Arc<str>, String> {
        if let Some(named) = event.topic() {
            let full = (self.routes.expand)(named);
            return Ok(self.intern(full));
        }
        if let Some(template) = &self.routes.template {
            let mut rendered = template
                .replace("{aggregate_type}", event.aggregate_type())
                .replace("{event_type}", event.event_type());
            for (name, value) in &self.routes.variables {
                rendered = rendered.replace(&format!("{{{name}}}"), value);
            }
            return Ok(self.intern(rendered));
        }
        self.default
            .clone()
            .ok_or_else(|| self.routes.missing.clone())
    }

    fn intern(&mut self, name: String) -> Arc<str> {
        if let Some(found) = self.cache.get(&name) {
            return Arc::clone(found);
        }
        let interned: Arc<str> = Arc::from(name.as_str());
        if self.cache.len() < 10_000 {
            self.cache.insert(name, Arc::clone(&interned));
        }
        interned
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Fields, Payload};

    pub(crate) fn event(topic: Option<&str>) -> OutboxEvent {
        OutboxEvent::new(
            Fields {
                id: "1",
                aggregate_type: "order",
                aggregate_id: "o-1",
                event_type: "OrderCreated",
                group: "o-1",
                time: "t",
                headers: None,
                topic,
            },
            Payload::Json("{}".into()),
        )
    }

    #[test]
    fn the_row_wins_then_the_template_then_the_default() {
        let mut routes = Routes {
            default: Some("main".into()),
            template: None,
            variables: vec![("zone", "z1".into())],
            expand: Arc::new(|name| format!("full:{name}")),
            missing: "nowhere".into(),
        };
        let mut r = Router::new(routes.clone());
        assert_eq!(&*r.route(&event(None)).unwrap(), "main");
        assert_eq!(&*r.route(&event(Some("audit"))).unwrap(), "full:audit");
        routes.template = Some("{zone}/{aggregate_type}/{event_type}".into());
        let mut r = Router::new(routes.clone());
        assert_eq!(&*r.route(&event(None)).unwrap(), "z1/order/OrderCreated");
        routes.template = None;
        routes.default = None;
        let mut r = Router::new(routes);
        assert_eq!(r.route(&event(None)).unwrap_err(), "nowhere");
    }

    #[test]
    fn templates_name_only_known_placeholders() {
        let mut problems = Vec::new();
        let mut bad = |key: &str, message: String| problems.push((key.to_owned(), message));
        check_template("x.t", "{zone}-{aggregate_type}", &["zone"], &mut bad);
        check_template("x.t", "{nope}", &["zone"], &mut bad);
        check_template("x.t", "a{b", &[], &mut bad);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].1.contains("{nope}") && problems[0].1.contains("{zone}"));
        assert!(problems[1].1.contains("not closed"));
    }
}

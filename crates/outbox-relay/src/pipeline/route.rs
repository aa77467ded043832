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
//! their rules as [`Routes`] ([`crate::config::settings::Settings::routes`]).
//! A name that a row or a template gives is held to the sink's
//! [`Allowed`](crate::config::allow::Allowed) rules first (routing is
//! configuration, not data: [`crate::config::allow`]); one outside
//! them is an error here, so the event is recorded as failed and nothing is
//! sent for it. A route the rules allow that names no existing destination is
//! not an error here: the destination answers that it does not exist, and the
//! sink rejects the event (recorded as failed).

use std::collections::HashMap;
use std::sync::Arc;

pub(crate) use crate::config::settings::Routes;
use crate::event::OutboxEvent;

/// Computes each event's destination.
#[derive(Debug, Clone)]
pub(crate) struct Router {
    routes: Routes,
    default: Option<Arc<str>>,
    /// What each distinct name a row or template gave came to, so each is
    /// checked and allocated once.
    cache: HashMap<String, Result<Arc<str>, String>>,
}

impl Router {
    /// A router following `routes`.
    pub(crate) fn new(routes: Routes) -> Self {
        Self {
            default: routes.default.as_deref().map(Arc::from),
            routes,
            cache: HashMap::new(),
        }
    }

    /// The event's destination, or why it has none (or may not have the
    /// one its data names).
    pub(crate) fn route(&mut self, event: &OutboxEvent) -> Result<Arc<str>, String> {
        if let Some(named) = event.topic() {
            let full = (self.routes.expand)(named);
            return self.admit(full);
        }
        if let Some(template) = &self.routes.template {
            let rendered = render(template, event, &self.routes)?;
            return self.admit(rendered);
        }
        self.default
            .clone()
            .ok_or_else(|| self.routes.missing.clone())
    }

    /// `name` if the rules allow it, else why not.
    fn admit(&mut self, name: String) -> Result<Arc<str>, String> {
        if let Some(found) = self.cache.get(&name) {
            return found.clone();
        }
        let verdict = self
            .routes
            .allowed
            .check(&name)
            .map(|()| Arc::from(name.as_str()));
        if self.cache.len() < 10_000 {
            self.cache.insert(name, verdict.clone());
        }
        verdict
    }
}

/// `template` with its placeholders filled in one pass, so a row's value
/// that holds a placeholder's text stays text: `{aggregate_type}` and
/// `{event_type}` escaped by the sink's rule, the sink's variables as they
/// are. Validation has refused templates with other placeholders.
fn render(template: &str, event: &OutboxEvent, routes: &Routes) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() + 32);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}').map(|c| open + c) else {
            break;
        };
        out.push_str(&rest[..open]);
        let name = &rest[open + 1..close];
        match name {
            "aggregate_type" => out.push_str(&(routes.escape)(event.aggregate_type())?),
            "event_type" => out.push_str(&(routes.escape)(event.event_type())?),
            _ => match routes.variables.iter().find(|(n, _)| *n == name) {
                Some((_, value)) => out.push_str(value),
                None => out.push_str(&rest[open..=close]),
            },
        }
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::settings::{check_template, Allowed};
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
            allowed: Allowed::patterns(["full:*".into(), "z1/*/*".into()]),
            escape: crate::config::settings::verbatim,
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
    fn a_row_or_template_naming_what_the_rules_do_not_allow_gets_no_route() {
        let routes = Routes {
            default: Some("https://hooks.test/in".into()),
            template: None,
            variables: Vec::new(),
            expand: Arc::new(str::to_owned),
            missing: "nowhere".into(),
            allowed: Allowed::origins(["https://hooks.test/in"]).unwrap(),
            escape: crate::config::allow::encode_path_value,
        };
        let mut r = Router::new(routes.clone());
        assert_eq!(
            &*r.route(&event(Some("https://hooks.test/other"))).unwrap(),
            "https://hooks.test/other"
        );
        for _ in 0..2 {
            let why = r
                .route(&event(Some("http://127.0.0.1:9187/admin")))
                .unwrap_err();
            assert!(
                why.contains("not a destination the configuration allows"),
                "{why}"
            );
        }
        let mut templated = routes;
        templated.template = Some("https://hooks.test/{aggregate_type}".into());
        let mut r = Router::new(templated);
        assert_eq!(&*r.route(&event(None)).unwrap(), "https://hooks.test/order");
        let evil = OutboxEvent::new(
            Fields {
                id: "2",
                aggregate_type: "..",
                aggregate_id: "a",
                event_type: "E",
                group: "a",
                time: "t",
                headers: None,
                topic: None,
            },
            Payload::Json("{}".into()),
        );
        assert!(r.route(&evil).unwrap_err().contains("climb"));
    }

    #[test]
    fn a_value_holding_a_placeholder_stays_text() {
        let routes = Routes {
            default: None,
            template: Some("arn:aws:sns:{region}:{account}:{aggregate_type}-{event_type}".into()),
            variables: vec![("region", "eu-west-1".into()), ("account", "1".into())],
            expand: Arc::new(str::to_owned),
            missing: "nowhere".into(),
            allowed: Allowed::patterns(["arn:aws:sns:eu-west-1:1:*".into()]),
            escape: crate::config::settings::verbatim,
        };
        let odd = OutboxEvent::new(
            Fields {
                id: "1",
                aggregate_type: "{event_type}",
                aggregate_id: "a",
                event_type: "{account}",
                group: "a",
                time: "t",
                headers: None,
                topic: None,
            },
            Payload::Json("{}".into()),
        );
        assert_eq!(
            render(routes.template.as_deref().unwrap(), &odd, &routes).unwrap(),
            "arn:aws:sns:eu-west-1:1:{event_type}-{account}"
        );
        let mut r = Router::new(routes);
        assert!(r.route(&odd).is_err(), "braces are no topic name");
        assert_eq!(
            &*r.route(&event(None)).unwrap(),
            "arn:aws:sns:eu-west-1:1:order-OrderCreated"
        );
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

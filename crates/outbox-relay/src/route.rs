//! Routing: which topic an event goes to.
//!
//! In order of precedence:
//! 1. the row's own topic (`columns.topic`), a full ARN or a bare topic name
//!    (expanded with the configured region and account);
//! 2. `sns.topic_template`, e.g. `arn:aws:sns:{region}:{account}:{aggregate_type}`;
//! 3. `sns.topic_arn`, the default topic.
//!
//! A route that names no existing topic is not an error here: SNS answers
//! `NotFound`, and the event is rejected (recorded as failed) by the sink.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::SnsConfig;
use crate::event::OutboxEvent;

/// Computes each event's destination.
#[derive(Debug, Clone, Default)]
pub struct Router {
    default: Option<Arc<str>>,
    template: Option<String>,
    region: String,
    account: String,
    /// Rendered destinations, so each distinct one is allocated once.
    cache: HashMap<String, Arc<str>>,
}

/// A destination for sinks that have only one (stdout).
pub fn nowhere() -> Arc<str> {
    Arc::from("")
}

impl Router {
    /// A router for the SNS sink.
    pub fn sns(config: &SnsConfig) -> Self {
        Self {
            default: (!config.topic_arn.is_empty()).then(|| Arc::from(config.topic_arn.as_str())),
            template: (!config.topic_template.is_empty()).then(|| config.topic_template.clone()),
            region: config.region_or_arn().unwrap_or_default().to_owned(),
            account: config.account().unwrap_or_default().to_owned(),
            cache: HashMap::new(),
        }
    }

    /// A router that sends everything to one unnamed destination.
    pub fn single() -> Self {
        Self {
            default: Some(nowhere()),
            ..Self::default()
        }
    }

    /// The event's destination, or why it has none.
    pub fn route(&mut self, event: &OutboxEvent) -> Result<Arc<str>, String> {
        if let Some(topic) = event.topic() {
            let arn = if topic.starts_with("arn:") {
                topic.to_owned()
            } else {
                format!("arn:aws:sns:{}:{}:{topic}", self.region, self.account)
            };
            return Ok(self.intern(arn));
        }
        if let Some(template) = &self.template {
            let arn = template
                .replace("{region}", &self.region)
                .replace("{account}", &self.account)
                .replace("{aggregate_type}", event.aggregate_type())
                .replace("{event_type}", event.event_type());
            return Ok(self.intern(arn));
        }
        self.default
            .clone()
            .ok_or_else(|| "no topic: the row names none and sns.topic_arn is not set".to_owned())
    }

    fn intern(&mut self, arn: String) -> Arc<str> {
        if let Some(found) = self.cache.get(&arn) {
            return Arc::clone(found);
        }
        let interned: Arc<str> = Arc::from(arn.as_str());
        if self.cache.len() < 10_000 {
            self.cache.insert(arn, Arc::clone(&interned));
        }
        interned
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Fields, Payload};

    fn event(topic: Option<&str>) -> OutboxEvent {
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
    fn the_row_topic_wins_then_the_template_then_the_default() {
        let mut config = SnsConfig {
            topic_arn: "arn:aws:sns:eu-west-1:111:default".into(),
            ..SnsConfig::default()
        };
        let mut r = Router::sns(&config);
        assert_eq!(
            &*r.route(&event(None)).unwrap(),
            "arn:aws:sns:eu-west-1:111:default"
        );
        assert_eq!(
            &*r.route(&event(Some("audit"))).unwrap(),
            "arn:aws:sns:eu-west-1:111:audit"
        );
        assert_eq!(
            &*r.route(&event(Some("arn:aws:sns:us-east-1:222:x")))
                .unwrap(),
            "arn:aws:sns:us-east-1:222:x"
        );
        config.topic_template = "arn:aws:sns:{region}:{account}:{aggregate_type}-events".into();
        let mut r = Router::sns(&config);
        assert_eq!(
            &*r.route(&event(None)).unwrap(),
            "arn:aws:sns:eu-west-1:111:order-events"
        );
    }
}

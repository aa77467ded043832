//! `[columns]`: which outbox column holds which part of an event (a leaf:
//! the event model reads it without the rest of the configuration).

use serde::Deserialize;

/// `[columns]`: the outbox table's column names. The first five are required
/// in the table; `headers`, `topic` and `created_at` are used when the table
/// has them, and an empty name switches one off.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ColumnMapping {
    /// Event id (becomes the envelope id and the deduplication id).
    pub id: String,
    /// Aggregate type, e.g. `order`.
    pub aggregate_type: String,
    /// Aggregate id; the default ordering group.
    pub aggregate_id: String,
    /// Event type, e.g. `OrderCreated`.
    pub event_type: String,
    /// Payload: jsonb, json, text or bytea.
    pub payload: String,
    /// Headers (jsonb object of strings): trace context, correlation ids.
    pub headers: String,
    /// Per-row topic override.
    pub topic: String,
    /// When the event happened; the commit time is used without it.
    pub created_at: String,
    /// Ordering group (the FIFO MessageGroupId); empty means the aggregate id.
    pub group: String,
}

impl Default for ColumnMapping {
    fn default() -> Self {
        Self {
            id: "id".into(),
            aggregate_type: "aggregate_type".into(),
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            payload: "payload".into(),
            headers: "headers".into(),
            topic: "topic".into(),
            created_at: "created_at".into(),
            group: String::new(),
        }
    }
}

impl ColumnMapping {
    /// The required columns with their keys, in table order of the default schema.
    pub fn required(&self) -> [(&'static str, &str); 5] {
        [
            ("id", &self.id),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
            ("payload", &self.payload),
        ]
    }

    /// The optional columns with their keys (an empty name is switched off).
    pub fn optional(&self) -> [(&'static str, &str); 3] {
        [
            ("headers", &self.headers),
            ("topic", &self.topic),
            ("created_at", &self.created_at),
        ]
    }

    /// The ordering group column: `group`, or the aggregate id column.
    pub fn group_column(&self) -> &str {
        if self.group.is_empty() {
            &self.aggregate_id
        } else {
            &self.group
        }
    }
}

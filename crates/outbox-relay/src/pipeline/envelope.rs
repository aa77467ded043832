//! From an [`OutboxEvent`] to the bytes of a message.
//!
//! `cloudevents` (the default) writes a CloudEvents 1.0 structured-mode JSON
//! object:
//!
//! | attribute         | from                                                      |
//! |-------------------|-----------------------------------------------------------|
//! | `specversion`     | `"1.0"`                                                   |
//! | `id`              | the outbox id (also the FIFO deduplication id)            |
//! | `source`          | `[envelope] source`, default `/<database>/<schema>.<table>` |
//! | `type`            | event type                                                |
//! | `subject`         | aggregate id                                              |
//! | `time`            | `created_at`, or the commit time                          |
//! | `datacontenttype` | `application/json`, `text/plain` or `application/octet-stream` |
//! | `aggregatetype`   | aggregate type (extension)                                |
//! | headers           | each string-valued header as an extension (name lower-cased, non-alphanumerics dropped) |
//! | `data`            | the payload as JSON when it is JSON, else as a JSON string |
//! | `data_base64`     | a bytea payload                                           |
//!
//! `raw` writes the payload alone (a bytea payload base64-encoded, since
//! message bodies are text).
//!
//! The JSON is written straight into the output buffer: a jsonb payload is
//! copied in as Postgres printed it, with no parse and no intermediate tree.

use base64::Engine as _;
use serde_json::value::RawValue;

use crate::config::EnvelopeFormat;
use crate::event::{OutboxEvent, Payload};

/// CloudEvents context attributes that a header must not shadow.
const RESERVED: &[&str] = &[
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
    "data_base64",
    "aggregatetype",
];

/// Encodes events in the configured format.
#[derive(Debug, Clone)]
pub(crate) struct Encoder {
    format: EnvelopeFormat,
    /// The `source` attribute, already a JSON string literal.
    source_json: String,
}

impl Encoder {
    /// An encoder for `format` with CloudEvents `source`.
    pub(crate) fn new(format: EnvelopeFormat, source: &str) -> Self {
        Self {
            format,
            source_json: serde_json::to_string(source).expect("a string serializes"),
        }
    }

    /// The default `source`: `/<database>/<schema>.<table>`.
    pub(crate) fn default_source(database: &str, table: &crate::config::TableName) -> String {
        format!("/{database}/{table}")
    }

    /// Append the message body for `event` to `out`.
    pub(crate) fn encode(&self, event: &OutboxEvent, out: &mut Vec<u8>) {
        match self.format {
            EnvelopeFormat::Cloudevents => self.cloudevent(event, out),
            EnvelopeFormat::Raw => match &event.payload {
                Payload::Json(t) | Payload::Text(t) => out.extend_from_slice(t.bytes()),
                Payload::Binary(b) => base64_into(b, out),
            },
        }
    }

    fn cloudevent(&self, event: &OutboxEvent, out: &mut Vec<u8>) {
        out.reserve(256 + payload_len(&event.payload));
        out.extend_from_slice(b"{\"specversion\":\"1.0\",\"id\":");
        json_string(event.id(), out);
        out.extend_from_slice(b",\"source\":");
        out.extend_from_slice(self.source_json.as_bytes());
        out.extend_from_slice(b",\"type\":");
        json_string(event.event_type(), out);
        out.extend_from_slice(b",\"subject\":");
        json_string(event.aggregate_id(), out);
        out.extend_from_slice(b",\"time\":");
        json_string(event.time(), out);
        out.extend_from_slice(b",\"aggregatetype\":");
        json_string(event.aggregate_type(), out);
        if let Some(headers) = event.headers() {
            header_extensions(headers, out);
        }
        match &event.payload {
            Payload::Json(json) => {
                out.extend_from_slice(b",\"datacontenttype\":\"application/json\",\"data\":");
                out.extend_from_slice(json.bytes());
            }
            Payload::Text(text) => {
                if serde_json::from_str::<&RawValue>(text.as_str()).is_ok() {
                    out.extend_from_slice(b",\"datacontenttype\":\"application/json\",\"data\":");
                    out.extend_from_slice(text.bytes());
                } else {
                    out.extend_from_slice(b",\"datacontenttype\":\"text/plain\",\"data\":");
                    json_string(text.as_str(), out);
                }
            }
            Payload::Binary(bytes) => {
                out.extend_from_slice(
                    b",\"datacontenttype\":\"application/octet-stream\",\"data_base64\":\"",
                );
                base64_into(bytes, out);
                out.push(b'"');
            }
        }
        out.push(b'}');
    }
}

fn payload_len(p: &Payload) -> usize {
    match p {
        Payload::Json(t) | Payload::Text(t) => t.bytes().len(),
        Payload::Binary(b) => b.len() * 4 / 3 + 4,
    }
}

/// String-valued headers become extension attributes; others are skipped.
fn header_extensions(headers: &str, out: &mut Vec<u8>) {
    let Ok(map) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(headers)
    else {
        tracing::debug!("headers are not a JSON object; no extensions added");
        return;
    };
    let mut written: Vec<String> = Vec::new();
    for (key, value) in &map {
        let serde_json::Value::String(value) = value else {
            continue;
        };
        let name = extension_name(key);
        if name.is_empty() || RESERVED.contains(&name.as_str()) || written.contains(&name) {
            continue;
        }
        out.push(b',');
        json_string(&name, out);
        out.push(b':');
        json_string(value, out);
        written.push(name);
    }
}

/// CloudEvents attribute names are lower-case letters and digits.
pub(crate) fn extension_name(key: &str) -> String {
    key.chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

fn json_string(s: &str, out: &mut Vec<u8>) {
    // Ids, types, subjects and times rarely hold a byte JSON escapes (a
    // control character, `"` or `\`): those are copied as they are, the
    // rest goes through serde_json. Both write the same bytes.
    // Every byte looked at, no early exit: the compiler checks a vector of
    // bytes at a time.
    let plain = s.bytes().fold(true, |plain, b| {
        plain & (b >= 0x20) & (b != b'"') & (b != b'\\')
    });
    if plain {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
    }
}

fn base64_into(bytes: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(
        start + base64::encoded_len(bytes.len(), true).unwrap_or(0),
        0,
    );
    let written = base64::engine::general_purpose::STANDARD
        .encode_slice(bytes, &mut out[start..])
        .expect("buffer sized by encoded_len");
    out.truncate(start + written);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Fields;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    proptest! {
        #[test]
        fn strings_are_written_as_serde_json_writes_them(s in any::<String>(), plain in "[ -~]{0,40}") {
            for s in [s, plain] {
                let mut out = Vec::new();
                json_string(&s, &mut out);
                prop_assert_eq!(out, serde_json::to_vec(&s).unwrap());
            }
        }
    }

    fn event(payload: Payload, headers: Option<&str>) -> OutboxEvent {
        OutboxEvent::new(
            Fields {
                id: "0b7c8a52-1f0e-4f57-9a47-3d0c6c0f1a11",
                aggregate_type: "order",
                aggregate_id: "ord-42",
                event_type: "OrderCreated",
                group: "ord-42",
                time: "2026-11-22T05:48:24.123456Z",
                headers,
                topic: None,
            },
            payload,
        )
    }

    fn encode(format: EnvelopeFormat, e: &OutboxEvent) -> Vec<u8> {
        let mut out = Vec::new();
        Encoder::new(format, "/app/public.outbox").encode(e, &mut out);
        out
    }

    #[test]
    fn a_json_payload_becomes_a_structured_cloudevent() {
        let e = event(
            Payload::Json(r#"{"total": 12.5, "lines": [1, 2]}"#.into()),
            Some(r#"{"traceparent": "00-abc-def-01", "correlation_id": "c-1", "n": 3, "id": "x"}"#),
        );
        let v: Value = serde_json::from_slice(&encode(EnvelopeFormat::Cloudevents, &e)).unwrap();
        assert_eq!(
            v,
            json!({
                "specversion": "1.0",
                "id": "0b7c8a52-1f0e-4f57-9a47-3d0c6c0f1a11",
                "source": "/app/public.outbox",
                "type": "OrderCreated",
                "subject": "ord-42",
                "time": "2026-11-22T05:48:24.123456Z",
                "aggregatetype": "order",
                "traceparent": "00-abc-def-01",
                "correlationid": "c-1",
                "datacontenttype": "application/json",
                "data": {"total": 12.5, "lines": [1, 2]}
            })
        );
    }

    #[test]
    fn text_that_is_not_json_becomes_a_string() {
        let e = event(Payload::Text("not \"json\"".into()), None);
        let v: Value = serde_json::from_slice(&encode(EnvelopeFormat::Cloudevents, &e)).unwrap();
        assert_eq!(v["data"], "not \"json\"");
        assert_eq!(v["datacontenttype"], "text/plain");
        let e = event(Payload::Text("[1,2]".into()), None);
        let v: Value = serde_json::from_slice(&encode(EnvelopeFormat::Cloudevents, &e)).unwrap();
        assert_eq!(v["data"], json!([1, 2]));
    }

    #[test]
    fn binary_becomes_data_base64() {
        let e = event(
            Payload::Binary(bytes::Bytes::from_static(&[0, 1, 254, 255])),
            None,
        );
        let v: Value = serde_json::from_slice(&encode(EnvelopeFormat::Cloudevents, &e)).unwrap();
        assert_eq!(v["data_base64"], "AAH+/w==");
        assert!(v.get("data").is_none());
        assert_eq!(encode(EnvelopeFormat::Raw, &e), b"AAH+/w==");
    }

    #[test]
    fn raw_is_the_payload_as_is() {
        let e = event(Payload::Json(r#"{"a": 1}"#.into()), Some(r#"{"x":"y"}"#));
        assert_eq!(encode(EnvelopeFormat::Raw, &e), br#"{"a": 1}"#);
    }

    #[test]
    fn strings_are_escaped() {
        let e = event(Payload::Json("null".into()), Some("not json"));
        let e = OutboxEvent::new(
            Fields {
                event_type: "Quote\"d\n",
                ..e.fields()
            },
            e.payload.clone(),
        );
        let v: Value = serde_json::from_slice(&encode(EnvelopeFormat::Cloudevents, &e)).unwrap();
        assert_eq!(v["type"], "Quote\"d\n");
    }
}

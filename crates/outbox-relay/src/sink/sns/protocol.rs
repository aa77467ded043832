//! SNS's wire format (the AWS query protocol, API version 2010-03-31) for
//! the one call the relay makes, `PublishBatch`: the request is an
//! `application/x-www-form-urlencoded` body, the answer XML.
//!
//! The body is written once, straight from the batch's messages, into one
//! buffer: no request tree, no per-field strings. Values are percent-encoded
//! as the AWS SDKs do (everything but `A-Z a-z 0-9 - . _ ~`).

use std::borrow::Cow;

use aws_smithy_xml::decode::{try_data, Document, ScopedDecoder, XmlDecodeError};

/// One entry of a `PublishBatch` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<'a> {
    /// The entry id: the message's index in the sink's batch.
    pub index: usize,
    /// The message body.
    pub message: &'a str,
    /// `String` message attributes: name and (non-empty) value.
    pub attributes: Vec<(&'a str, Cow<'a, str>)>,
    /// FIFO topics: `MessageGroupId` and `MessageDeduplicationId`.
    pub fifo: Option<(Cow<'a, str>, Cow<'a, str>)>,
}

/// The form body of a `PublishBatch` of `entries` to `topic`.
pub fn publish_batch_body(topic: &str, entries: &[Entry<'_>]) -> Vec<u8> {
    let estimate = entries
        .iter()
        .map(|e| e.message.len() * 3 / 2 + 400)
        .sum::<usize>()
        + 200;
    let mut body = Vec::with_capacity(estimate);
    body.extend_from_slice(b"Action=PublishBatch&Version=2010-03-31&TopicArn=");
    encode(&mut body, topic);
    for (n, entry) in entries.iter().enumerate() {
        let member = n + 1;
        let field = |body: &mut Vec<u8>, name: std::fmt::Arguments<'_>, value: &str| {
            use std::io::Write as _;
            write!(body, "&PublishBatchRequestEntries.member.{member}.{name}=")
                .expect("writing to a Vec");
            encode(body, value);
        };
        field(&mut body, format_args!("Id"), &entry.index.to_string());
        field(&mut body, format_args!("Message"), entry.message);
        if let Some((group, dedup)) = &entry.fifo {
            field(&mut body, format_args!("MessageGroupId"), group);
            field(&mut body, format_args!("MessageDeduplicationId"), dedup);
        }
        for (k, (name, value)) in entry.attributes.iter().enumerate() {
            let k = k + 1;
            field(
                &mut body,
                format_args!("MessageAttributes.entry.{k}.Name"),
                name,
            );
            field(
                &mut body,
                format_args!("MessageAttributes.entry.{k}.Value.DataType"),
                "String",
            );
            field(
                &mut body,
                format_args!("MessageAttributes.entry.{k}.Value.StringValue"),
                value,
            );
        }
    }
    body
}

/// Percent-encode `value` onto `out`, leaving only RFC 3986's unreserved
/// characters as they are.
fn encode(out: &mut Vec<u8>, value: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let bytes = value.as_bytes();
    let mut plain = 0; // start of the current run of unreserved bytes
    for (i, &b) in bytes.iter().enumerate() {
        if !(b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')) {
            out.extend_from_slice(&bytes[plain..i]);
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
            plain = i + 1;
        }
    }
    out.extend_from_slice(&bytes[plain..]);
}

/// What SNS said about one entry of a `PublishBatch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryResult {
    /// Listed under `Successful`.
    Published {
        /// The entry id.
        id: String,
    },
    /// Listed under `Failed`.
    Failed {
        /// The entry id.
        id: String,
        /// SNS's error code, e.g. `InvalidParameter`.
        code: String,
        /// SNS's explanation, when it gave one.
        message: Option<String>,
        /// Whether the entry itself is at fault (sending it again will not help).
        sender_fault: bool,
    },
}

/// The entries of a `PublishBatchResponse`, successful and failed.
pub fn parse_publish_batch(xml: &[u8]) -> Result<Vec<EntryResult>, XmlDecodeError> {
    let mut doc = Document::try_from(xml)?;
    let mut root = doc.root_element()?;
    if !root.start_el().matches("PublishBatchResponse") {
        return Err(XmlDecodeError::custom(format!(
            "expected PublishBatchResponse, found {}",
            root.start_el().local()
        )));
    }
    let mut results = Vec::new();
    while let Some(mut tag) = root.next_tag() {
        if !tag.start_el().matches("PublishBatchResult") {
            continue;
        }
        while let Some(mut list) = tag.next_tag() {
            let successful = list.start_el().matches("Successful");
            if !successful && !list.start_el().matches("Failed") {
                continue;
            }
            while let Some(mut member) = list.next_tag() {
                if !member.start_el().matches("member") {
                    continue;
                }
                let (mut id, mut code, mut message, mut sender_fault) =
                    (String::new(), String::new(), None, false);
                while let Some(mut field) = member.next_tag() {
                    let name = field.start_el().local().to_owned();
                    let text = try_data(&mut field)?.into_owned();
                    match name.as_str() {
                        "Id" => id = text,
                        "Code" => code = text,
                        "Message" => message = Some(text),
                        "SenderFault" => sender_fault = text.trim() == "true",
                        _ => {}
                    }
                }
                results.push(if successful {
                    EntryResult::Published { id }
                } else {
                    EntryResult::Failed {
                        id,
                        code,
                        message,
                        sender_fault,
                    }
                });
            }
        }
    }
    Ok(results)
}

/// The `Code` and `Message` of an error answer (`ErrorResponse/Error`, also
/// found nested a level deeper), when the body is one.
pub fn parse_error(xml: &[u8]) -> Option<(String, Option<String>)> {
    let mut doc = Document::try_from(xml).ok()?;
    let mut root = doc.root_element().ok()?;
    find_error(&mut root, 0)
}

fn find_error(scope: &mut ScopedDecoder<'_, '_>, depth: usize) -> Option<(String, Option<String>)> {
    if depth > 3 {
        return None;
    }
    while let Some(mut tag) = scope.next_tag() {
        if tag.start_el().matches("Error") {
            let (mut code, mut message) = (None, None);
            while let Some(mut field) = tag.next_tag() {
                let name = field.start_el().local().to_owned();
                let text = try_data(&mut field).ok().map(Cow::into_owned);
                match name.as_str() {
                    "Code" => code = text,
                    "Message" => message = text,
                    _ => {}
                }
            }
            return code.map(|code| (code, message));
        }
        if let Some(found) = find_error(&mut tag, depth + 1) {
            return Some(found);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(body: &[u8]) -> Vec<(String, String)> {
        // The standard form decoding, as a server does it.
        String::from_utf8(body.to_vec())
            .unwrap()
            .split('&')
            .map(|pair| {
                let (k, v) = pair.split_once('=').unwrap();
                let unescape = |s: &str| {
                    let mut out = Vec::new();
                    let b = s.as_bytes();
                    let mut i = 0;
                    while i < b.len() {
                        if b[i] == b'%' {
                            out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
                            i += 3;
                        } else {
                            assert!(b[i].is_ascii_alphanumeric() || b"-._~".contains(&b[i]));
                            out.push(b[i]);
                            i += 1;
                        }
                    }
                    String::from_utf8(out).unwrap()
                };
                (unescape(k), unescape(v))
            })
            .collect()
    }

    #[test]
    fn a_batch_body_carries_every_field_and_survives_form_decoding() {
        let message = "{\"a\": \"b & c = d%\", \"é\": \"→ +\"}";
        let entries = [
            Entry {
                index: 3,
                message,
                attributes: vec![
                    ("event_id", Cow::Borrowed("e-1")),
                    ("traceparent", Cow::Owned("00-ab cd".into())),
                ],
                fifo: Some((Cow::Borrowed("order/7"), Cow::Borrowed("e-1"))),
            },
            Entry {
                index: 4,
                message: "x",
                attributes: vec![],
                fifo: None,
            },
        ];
        let topic = "arn:aws:sns:us-east-1:123456789012:orders.fifo";
        let fields = decode(&publish_batch_body(topic, &entries));
        let get = |k: &str| {
            fields
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
                .unwrap_or_else(|| panic!("{k} missing from {fields:?}"))
        };
        assert_eq!(get("Action"), "PublishBatch");
        assert_eq!(get("Version"), "2010-03-31");
        assert_eq!(get("TopicArn"), topic);
        let m1 = "PublishBatchRequestEntries.member.1";
        assert_eq!(get(&format!("{m1}.Id")), "3");
        assert_eq!(get(&format!("{m1}.Message")), message);
        assert_eq!(get(&format!("{m1}.MessageGroupId")), "order/7");
        assert_eq!(get(&format!("{m1}.MessageDeduplicationId")), "e-1");
        assert_eq!(
            get(&format!("{m1}.MessageAttributes.entry.2.Name")),
            "traceparent"
        );
        assert_eq!(
            get(&format!("{m1}.MessageAttributes.entry.2.Value.DataType")),
            "String"
        );
        assert_eq!(
            get(&format!("{m1}.MessageAttributes.entry.2.Value.StringValue")),
            "00-ab cd"
        );
        let m2 = "PublishBatchRequestEntries.member.2";
        assert_eq!(get(&format!("{m2}.Id")), "4");
        assert_eq!(get(&format!("{m2}.Message")), "x");
        assert!(!fields
            .iter()
            .any(|(k, _)| k.starts_with(&format!("{m2}.MessageGroupId"))));
        assert_eq!(fields.len(), 3 + 4 + 2 * 3 + 2);
    }

    #[test]
    fn a_publish_batch_answer_lists_successful_and_failed_entries() {
        let xml = br#"<PublishBatchResponse xmlns="http://sns.amazonaws.com/doc/2010-03-31/">
  <PublishBatchResult>
    <Failed>
      <member><Code>InvalidParameter</Code><Id>1</Id><Message>Message too long &amp; bad</Message><SenderFault>true</SenderFault></member>
    </Failed>
    <Successful>
      <member><Id>0</Id><MessageId>m-0</MessageId><SequenceNumber>1</SequenceNumber></member>
      <member><MessageId>m-2</MessageId><Id>2</Id></member>
    </Successful>
  </PublishBatchResult>
  <ResponseMetadata><RequestId>r</RequestId></ResponseMetadata>
</PublishBatchResponse>"#;
        assert_eq!(
            parse_publish_batch(xml).unwrap(),
            vec![
                EntryResult::Failed {
                    id: "1".into(),
                    code: "InvalidParameter".into(),
                    message: Some("Message too long & bad".into()),
                    sender_fault: true,
                },
                EntryResult::Published { id: "0".into() },
                EntryResult::Published { id: "2".into() },
            ]
        );
        assert!(parse_publish_batch(b"<ErrorResponse/>").is_err());
        assert!(parse_publish_batch(b"not xml").is_err());
    }

    #[test]
    fn error_answers_give_their_code_and_message() {
        let aws = br#"<ErrorResponse xmlns="http://sns.amazonaws.com/doc/2010-03-31/">
  <Error><Type>Sender</Type><Code>NotFound</Code><Message>Topic does not exist</Message></Error>
  <RequestId>r</RequestId></ErrorResponse>"#;
        assert_eq!(
            parse_error(aws),
            Some(("NotFound".into(), Some("Topic does not exist".into())))
        );
        let nested =
            b"<Response><Errors><Error><Code>Throttling</Code></Error></Errors></Response>";
        assert_eq!(parse_error(nested), Some(("Throttling".into(), None)));
        assert_eq!(parse_error(b"<html>Bad Gateway</html>"), None);
        assert_eq!(parse_error(b""), None);
    }
}

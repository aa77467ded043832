//! SNS's wire format (the AWS Query protocol, [`crate::sink::aws::query`],
//! API version 2010-03-31) for the calls the relay makes: `PublishBatch` and
//! `GetTopicAttributes`.
//!
//! The body is written once, straight from the batch's messages, into one
//! buffer: no request tree, no per-field strings.

use std::borrow::Cow;

use aws_smithy_xml::decode::{try_data, Document, XmlDecodeError};

use crate::sink::aws::query::encode;

/// One entry of a `PublishBatch` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry<'a> {
    /// The entry id: the message's index in the sink's batch.
    pub index: usize,
    /// The message body (UTF-8 text, as SNS requires: envelopes are JSON or
    /// base64, so they are by construction; SNS rejects anything else).
    pub message: &'a [u8],
    /// `String` message attributes: name and (non-empty) value.
    pub attributes: Vec<(&'a str, Cow<'a, str>)>,
    /// `Number` message attributes: name and value.
    pub numbers: Vec<(&'static str, String)>,
    /// FIFO topics: `MessageGroupId` and `MessageDeduplicationId`.
    pub fifo: Option<(Cow<'a, str>, Cow<'a, str>)>,
}

/// The form body of a `PublishBatch` of `entries` to `topic`.
pub(super) fn publish_batch_body(topic: &str, entries: &[Entry<'_>]) -> Vec<u8> {
    let estimate = entries
        .iter()
        .map(|e| e.message.len() * 3 / 2 + 600)
        .sum::<usize>()
        + 200;
    let mut body = Vec::with_capacity(estimate);
    body.extend_from_slice(b"Action=PublishBatch&Version=2010-03-31&TopicArn=");
    encode(&mut body, topic.as_bytes());
    let (mut member, mut id, mut attribute) = (
        itoa::Buffer::new(),
        itoa::Buffer::new(),
        itoa::Buffer::new(),
    );
    for (n, entry) in entries.iter().enumerate() {
        let member = member.format(n + 1).as_bytes();
        // `&PublishBatchRequestEntries.member.<n>.<field>=<value>`
        let field = |body: &mut Vec<u8>, field: &[&[u8]], value: &[u8]| {
            body.extend_from_slice(b"&PublishBatchRequestEntries.member.");
            body.extend_from_slice(member);
            body.push(b'.');
            for part in field {
                body.extend_from_slice(part);
            }
            body.push(b'=');
            encode(body, value);
        };
        field(&mut body, &[b"Id"], id.format(entry.index).as_bytes());
        field(&mut body, &[b"Message"], entry.message);
        if let Some((group, dedup)) = &entry.fifo {
            field(&mut body, &[b"MessageGroupId"], group.as_bytes());
            field(&mut body, &[b"MessageDeduplicationId"], dedup.as_bytes());
        }
        let typed = entry
            .attributes
            .iter()
            .map(|(name, value)| (*name, "String", value.as_ref()))
            .chain(
                entry
                    .numbers
                    .iter()
                    .map(|(name, value)| (*name, "Number", value.as_str())),
            );
        for (k, (name, data_type, value)) in typed.enumerate() {
            let k = attribute.format(k + 1).as_bytes();
            let prefix: &[u8] = b"MessageAttributes.entry.";
            field(&mut body, &[prefix, k, b".Name"], name.as_bytes());
            field(
                &mut body,
                &[prefix, k, b".Value.DataType"],
                data_type.as_bytes(),
            );
            field(
                &mut body,
                &[prefix, k, b".Value.StringValue"],
                value.as_bytes(),
            );
        }
    }
    body
}

/// The form body of a `GetTopicAttributes` of `topic`.
pub(super) fn get_topic_attributes_body(topic: &str) -> Vec<u8> {
    let mut body = b"Action=GetTopicAttributes&Version=2010-03-31&TopicArn=".to_vec();
    encode(&mut body, topic.as_bytes());
    body
}

/// The value of the topic attribute `name` in a `GetTopicAttributesResponse`
/// (`…/Attributes/entry/{key,value}`), `None` when the topic has none.
pub(super) fn parse_topic_attribute(
    xml: &[u8],
    name: &str,
) -> Result<Option<String>, XmlDecodeError> {
    let mut doc = Document::try_from(xml)?;
    let mut root = doc.root_element()?;
    if !root.start_el().matches("GetTopicAttributesResponse") {
        return Err(XmlDecodeError::custom(format!(
            "expected GetTopicAttributesResponse, found {}",
            root.start_el().local()
        )));
    }
    while let Some(mut result) = root.next_tag() {
        if !result.start_el().matches("GetTopicAttributesResult") {
            continue;
        }
        while let Some(mut attributes) = result.next_tag() {
            if !attributes.start_el().matches("Attributes") {
                continue;
            }
            while let Some(mut entry) = attributes.next_tag() {
                let (mut key, mut value) = (None, None);
                while let Some(mut field) = entry.next_tag() {
                    let which = field.start_el().local().to_owned();
                    let text = try_data(&mut field)?.into_owned();
                    match which.as_str() {
                        "key" => key = Some(text),
                        "value" => value = Some(text),
                        _ => {}
                    }
                }
                if key.as_deref() == Some(name) {
                    return Ok(value);
                }
            }
        }
    }
    Ok(None)
}

/// What SNS said about one entry of a `PublishBatch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum EntryResult {
    /// Listed under `Successful`.
    Published {
        /// The entry id (ours are numbers; any other is `None`).
        id: Option<usize>,
    },
    /// Listed under `Failed`.
    Failed {
        /// The entry id (ours are numbers; any other is `None`).
        id: Option<usize>,
        /// SNS's error code, e.g. `InvalidParameter`.
        code: String,
        /// SNS's explanation, when it gave one.
        message: Option<String>,
        /// Whether the entry itself is at fault (sending it again will not help).
        sender_fault: bool,
    },
}

/// The entries of a `PublishBatchResponse`, successful and failed.
pub(super) fn parse_publish_batch(xml: &[u8]) -> Result<Vec<EntryResult>, XmlDecodeError> {
    match all_published(xml) {
        Some(results) => Ok(results),
        None => parse_publish_batch_fully(xml),
    }
}

/// The common answer, read without an XML parser: every entry under
/// `Successful` with one numeric `Id`, `Failed` empty. `None` for anything
/// else (another element, a namespace prefix, a comment or CDATA, an entity
/// in an id, a failure), which the full parser then reads: this path may
/// only ever agree with it.
fn all_published(xml: &[u8]) -> Option<Vec<EntryResult>> {
    const KNOWN: [&[u8]; 10] = [
        b"PublishBatchResponse",
        b"PublishBatchResult",
        b"Successful",
        b"Failed",
        b"member",
        b"Id",
        b"MessageId",
        b"SequenceNumber",
        b"ResponseMetadata",
        b"RequestId",
    ];
    let mut open: Vec<&[u8]> = Vec::with_capacity(6);
    let mut results = Vec::with_capacity(10);
    let mut ids_in_member = 0;
    let mut roots = 0;
    let mut at = 0;
    while let Some(lt) = memchr::memchr(b'<', &xml[at..]) {
        let tag_start = at + lt;
        let gt = tag_start + memchr::memchr(b'>', &xml[tag_start..])?;
        let tag = &xml[tag_start + 1..gt];
        at = gt + 1;
        if let Some(prolog) = tag.strip_prefix(b"?") {
            // Only `<?xml …?>`, only first.
            if tag_start != 0 || !prolog.starts_with(b"xml") || !prolog.ends_with(b"?") {
                return None;
            }
            continue;
        }
        let (closing, body) = match tag.strip_prefix(b"/") {
            Some(body) => (true, body),
            None => (false, tag),
        };
        let self_closing = !closing && body.ends_with(b"/");
        let body = body.strip_suffix(b"/").unwrap_or(body);
        let name_end = body
            .iter()
            .position(|b| b.is_ascii_whitespace())
            .unwrap_or(body.len());
        let name = &body[..name_end];
        if !KNOWN.contains(&name) {
            return None; // unknown elements, prefixes, `<!…>`
        }
        let parent = open.last().copied();
        if closing {
            if parent != Some(name) || name_end != body.len() {
                return None;
            }
            open.pop();
            if name == b"member" && ids_in_member != 1 {
                return None;
            }
            continue;
        }
        // Where each element may be.
        let fits = match name {
            b"PublishBatchResponse" => parent.is_none(),
            b"PublishBatchResult" | b"ResponseMetadata" => parent == Some(b"PublishBatchResponse"),
            b"Successful" | b"Failed" => parent == Some(b"PublishBatchResult"),
            b"member" => parent == Some(b"Successful"), // a failure: the parser's job
            b"Id" | b"MessageId" | b"SequenceNumber" => parent == Some(b"member"),
            _ => parent == Some(b"ResponseMetadata"), // RequestId
        };
        if !fits {
            return None;
        }
        if name == b"PublishBatchResponse" {
            roots += 1;
        }
        if self_closing {
            if name == b"member" || name == b"Id" {
                return None;
            }
            continue;
        }
        if name == b"member" {
            ids_in_member = 0;
        }
        if name == b"Id" {
            let text_end = gt + 1 + memchr::memchr(b'<', &xml[gt + 1..])?;
            let digits = &xml[gt + 1..text_end];
            if digits.is_empty() || digits.len() > 9 || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let id = std::str::from_utf8(digits).ok()?.parse().ok()?;
            results.push(EntryResult::Published { id: Some(id) });
            ids_in_member += 1;
        }
        open.push(name);
    }
    let rest_is_blank = xml[at..].iter().all(u8::is_ascii_whitespace);
    (open.is_empty() && roots == 1 && rest_is_blank).then_some(results)
}

/// [`parse_publish_batch`] with the XML parser, for any shape of answer.
fn parse_publish_batch_fully(xml: &[u8]) -> Result<Vec<EntryResult>, XmlDecodeError> {
    let mut doc = Document::try_from(xml)?;
    let mut root = doc.root_element()?;
    if !root.start_el().matches("PublishBatchResponse") {
        return Err(XmlDecodeError::custom(format!(
            "expected PublishBatchResponse, found {}",
            root.start_el().local()
        )));
    }
    let mut results = Vec::with_capacity(10);
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
                    (None, String::new(), None, false);
                while let Some(mut field) = member.next_tag() {
                    enum Field {
                        Id,
                        Code,
                        Message,
                        SenderFault,
                    }
                    let which = match field.start_el().local() {
                        "Id" => Field::Id,
                        "Code" if !successful => Field::Code,
                        "Message" if !successful => Field::Message,
                        "SenderFault" if !successful => Field::SenderFault,
                        _ => continue, // MessageId, SequenceNumber: not needed
                    };
                    let text = try_data(&mut field)?;
                    match which {
                        Field::Id => id = text.trim().parse::<usize>().ok(),
                        Field::Code => code = text.into_owned(),
                        Field::Message => message = Some(text.into_owned()),
                        Field::SenderFault => sender_fault = text.trim() == "true",
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
                        } else if b[i] == b'+' {
                            out.push(b' ');
                            i += 1;
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
                message: message.as_bytes(),
                attributes: vec![
                    ("event_id", Cow::Borrowed("e-1")),
                    ("traceparent", Cow::Owned("00-ab cd".into())),
                ],
                fifo: Some((Cow::Borrowed("order/7"), Cow::Borrowed("e-1"))),
                numbers: vec![("ExtendedPayloadSize", "300000".into())],
            },
            Entry {
                index: 4,
                message: b"x",
                attributes: vec![],
                fifo: None,
                numbers: vec![],
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
        assert_eq!(
            get(&format!("{m1}.MessageAttributes.entry.3.Name")),
            "ExtendedPayloadSize"
        );
        assert_eq!(
            get(&format!("{m1}.MessageAttributes.entry.3.Value.DataType")),
            "Number"
        );
        assert_eq!(
            get(&format!("{m1}.MessageAttributes.entry.3.Value.StringValue")),
            "300000"
        );
        let m2 = "PublishBatchRequestEntries.member.2";
        assert_eq!(get(&format!("{m2}.Id")), "4");
        assert_eq!(get(&format!("{m2}.Message")), "x");
        assert!(!fields
            .iter()
            .any(|(k, _)| k.starts_with(&format!("{m2}.MessageGroupId"))));
        assert_eq!(fields.len(), 3 + 4 + 3 * 3 + 2);
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
      <member><Id>x-9</Id></member>
    </Successful>
  </PublishBatchResult>
  <ResponseMetadata><RequestId>r</RequestId></ResponseMetadata>
</PublishBatchResponse>"#;
        assert_eq!(
            parse_publish_batch(xml).unwrap(),
            vec![
                EntryResult::Failed {
                    id: Some(1),
                    code: "InvalidParameter".into(),
                    message: Some("Message too long & bad".into()),
                    sender_fault: true,
                },
                EntryResult::Published { id: Some(0) },
                EntryResult::Published { id: Some(2) },
                EntryResult::Published { id: None },
            ]
        );
        assert_eq!(all_published(xml), None, "failures take the full parser");
        assert!(parse_publish_batch(b"<ErrorResponse/>").is_err());
        assert!(parse_publish_batch(b"not xml").is_err());
    }

    #[test]
    fn the_common_answer_is_read_without_the_parser_and_agrees_with_it() {
        let aws = br#"<?xml version="1.0"?>
<PublishBatchResponse xmlns="http://sns.amazonaws.com/doc/2010-03-31/">
  <PublishBatchResult>
    <Failed/>
    <Successful>
      <member>
        <MessageId>4f2c1b7e-0000</MessageId>
        <Id>7</Id>
        <SequenceNumber>10000000000000003000</SequenceNumber>
      </member>
      <member><Id>8</Id><MessageId>m</MessageId></member>
    </Successful>
  </PublishBatchResult>
  <ResponseMetadata><RequestId>r</RequestId></ResponseMetadata>
</PublishBatchResponse>"#;
        let expected = vec![
            EntryResult::Published { id: Some(7) },
            EntryResult::Published { id: Some(8) },
        ];
        assert_eq!(all_published(aws), Some(expected.clone()));
        assert_eq!(parse_publish_batch_fully(aws).unwrap(), expected);
        let empty_failed =
            String::from_utf8_lossy(aws).replace("<Failed/>", "<Failed>\n  </Failed>");
        assert_eq!(
            all_published(empty_failed.as_bytes()),
            Some(expected.clone())
        );
        // Shapes left to the parser: an id that is not ours, a member without
        // an id, an id with an entity, something failed, another root.
        for odd in [
            String::from_utf8_lossy(aws).replace("<Id>8</Id>", "<Id>x</Id>"),
            String::from_utf8_lossy(aws).replace("<Id>8</Id>", ""),
            String::from_utf8_lossy(aws).replace("<Id>8</Id>", "<Id>&#56;</Id>"),
            String::from_utf8_lossy(aws).replace(
                "<Failed/>",
                "<Failed><member><Id>9</Id><Code>X</Code></member></Failed>",
            ),
            String::from_utf8_lossy(aws).replace("<?xml version=\"1.0\"?>", "<Other/>"),
        ] {
            assert_eq!(all_published(odd.as_bytes()), None, "{odd}");
        }
    }

    proptest::proptest! {
        /// Documents made of pieces of real answers and of what could trip
        /// a scanner: whenever the fast path answers, the parser agrees.
        #[test]
        fn the_fast_path_never_disagrees_with_the_parser(
            pieces in proptest::collection::vec(0usize..PIECES.len(), 0..14),
        ) {
            let mut doc = String::from(
                "<PublishBatchResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\"><PublishBatchResult><Successful>",
            );
            for i in pieces {
                doc.push_str(PIECES[i]);
            }
            doc.push_str("</Successful><Failed/></PublishBatchResult></PublishBatchResponse>");
            if let Some(fast) = all_published(doc.as_bytes()) {
                proptest::prop_assert_eq!(Some(fast), parse_publish_batch_fully(doc.as_bytes()).ok(), "{}", doc);
            }
        }
    }

    const PIECES: [&str; 16] = [
        "<member><Id>1</Id><MessageId>m</MessageId></member>",
        "<member><MessageId>m</MessageId><Id>2</Id></member>",
        "<member><Id>3</Id></member>",
        "<member>",
        "</member>",
        "<Id>4</Id>",
        "<!-- <member><Id>5</Id></member> -->",
        "<![CDATA[</member><member><Id>6</Id>]]>",
        "<sns:member><Id>7</Id></sns:member>",
        "<member><Other><Id>8</Id></Other></member>",
        "<member><Id>9</Id><Id>10</Id></member>",
        "<member/>",
        "</Successful><Successful>",
        "<member><Id>&#49;1</Id></member>",
        "\n  ",
        "<member><Id> 12</Id></member>",
    ];

    #[test]
    fn a_topic_attribute_is_read_from_its_answer() {
        let aws = br#"<GetTopicAttributesResponse xmlns="http://sns.amazonaws.com/doc/2010-03-31/">
  <GetTopicAttributesResult>
    <Attributes>
      <entry><key>Owner</key><value>123456789012</value></entry>
      <entry><key>MaximumMessageSize</key><value>1048576</value></entry>
      <entry><key>Policy</key><value>{&quot;Version&quot;:&quot;2008-10-17&quot;}</value></entry>
    </Attributes>
  </GetTopicAttributesResult>
  <ResponseMetadata><RequestId>r</RequestId></ResponseMetadata>
</GetTopicAttributesResponse>"#;
        assert_eq!(
            parse_topic_attribute(aws, "MaximumMessageSize").unwrap(),
            Some("1048576".into())
        );
        assert_eq!(
            parse_topic_attribute(aws, "Policy").unwrap().as_deref(),
            Some(r#"{"Version":"2008-10-17"}"#)
        );
        assert_eq!(parse_topic_attribute(aws, "FifoTopic").unwrap(), None);
        assert!(parse_topic_attribute(b"<ErrorResponse/>", "x").is_err());
        let body =
            String::from_utf8(get_topic_attributes_body("arn:aws:sns:us-east-1:1:t")).unwrap();
        assert_eq!(
            body,
            "Action=GetTopicAttributes&Version=2010-03-31&TopicArn=arn%3Aaws%3Asns%3Aus-east-1%3A1%3At"
        );
    }
}

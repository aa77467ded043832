//! Which destinations data may name: routing is configuration, not data.
//!
//! A row's `topic` column and a template filled with a row's values are
//! written by whoever may write the outbox table: the application's role, or
//! an SQL injection in the application. They choose *among* the destinations
//! the configuration allows and can name nothing else, so a row cannot make
//! the relay POST a signed envelope to an internal service or a metadata
//! endpoint, nor publish into another AWS account (DESIGN.md invariant 11).
//!
//! ```text
//! row topic / template ──► expand/render ──► Allowed::check ──┬─► the sink
//!                                                              └─► FAILED (reason), nothing sent
//! ```
//!
//! Two kinds of rule:
//!
//! * **Origins** (webhooks): scheme, host and port of a URL, compared as
//!   the browser's same-origin rule compares them (case-insensitive host, the
//!   scheme's default port filled in). The configured `url`'s origin is
//!   allowed; `webhook.allowed_origins` adds others.
//! * **Patterns** (AWS): a destination name (ARN, queue URL, bus or stream
//!   name) matched against a pattern in which `*` stands for a run of the
//!   characters AWS allows in a resource name (`A–Z a–z 0–9 _ - .`), so a
//!   `*` can never span a `:` or `/` and move the match into another
//!   partition, region, account, host or path. The configured destination's
//!   partition, region and account (bare names, which AWS resolves in the
//!   caller's account) are allowed; `allowed_destinations` adds others.
//!
//! The configured default destination (and the dead-letter topic) are the
//! operator's own words and are not checked.

/// The rules one sink's routes are held to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowed {
    rules: Vec<Rule>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Rule {
    /// A URL of this origin.
    Origin(Origin),
    /// A name matching this pattern (`*` as above).
    Pattern(String),
}

/// The origin of a URL: scheme, host and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    scheme: String,
    host: String,
    port: u16,
}

impl Origin {
    /// The origin of `url`, or why it has none (not http(s), no host).
    pub(crate) fn of(url: &str) -> Result<Self, String> {
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e| format!("{url:?} is not a URL: {e}"))?;
        let scheme = uri.scheme_str().unwrap_or_default().to_ascii_lowercase();
        let default_port = match scheme.as_str() {
            "http" => 80,
            "https" => 443,
            _ => return Err(format!("{url:?} is not an http:// or https:// URL")),
        };
        let authority = uri
            .authority()
            .ok_or_else(|| format!("{url:?} has no host"))?;
        if authority.as_str().contains('@') {
            return Err(format!(
                "{url:?} has user information before its host, which is refused"
            ));
        }
        let host = authority.host().to_ascii_lowercase();
        if host.is_empty() {
            return Err(format!("{url:?} has no host"));
        }
        Ok(Self {
            port: authority.port_u16().unwrap_or(default_port),
            scheme,
            host,
        })
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}:{}", self.scheme, self.host, self.port)
    }
}

impl Allowed {
    /// URLs of the origins of `urls` (each an `http(s)://host[:port]` URL,
    /// anything after the origin ignored).
    pub fn origins<'a>(urls: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let mut rules = Vec::new();
        for url in urls {
            let origin = Rule::Origin(Origin::of(url)?);
            if !rules.contains(&origin) {
                rules.push(origin);
            }
        }
        Ok(Self { rules })
    }

    /// Names matching one of `patterns`.
    pub fn patterns(patterns: impl IntoIterator<Item = String>) -> Self {
        let mut rules = Vec::new();
        for pattern in patterns {
            let rule = Rule::Pattern(pattern);
            if !rules.contains(&rule) {
                rules.push(rule);
            }
        }
        Self { rules }
    }

    /// Whether `name` (a full destination: URL, ARN, queue URL, bus or
    /// stream name) may be sent to, or why not (for the row's `last_error`).
    pub fn check(&self, name: &str) -> Result<(), String> {
        let origin = Origin::of(name).ok();
        let allowed = self.rules.iter().any(|rule| match rule {
            Rule::Origin(allowed) => origin.as_ref() == Some(allowed),
            Rule::Pattern(pattern) => matches(pattern, name),
        });
        if allowed {
            return Ok(());
        }
        let allowed = self.describe();
        Err(if allowed.is_empty() {
            format!(
                "{name:?} is not a destination the configuration allows: data may name none (add it to the sink's allow-list)"
            )
        } else {
            format!(
                "{name:?} is not a destination the configuration allows ({}; add it to the sink's allow-list)",
                allowed.join(", ")
            )
        })
    }

    /// The rules, one line each (`check` shows them).
    pub fn describe(&self) -> Vec<String> {
        self.rules
            .iter()
            .map(|rule| match rule {
                Rule::Origin(origin) => format!("origin {origin}"),
                Rule::Pattern(pattern) if pattern == "*" => {
                    "any bare name (in the relay's own account and region)".to_owned()
                }
                Rule::Pattern(pattern) => pattern.clone(),
            })
            .collect()
    }
}

/// The rule for ARNs beside `arn` (`arn:<partition>:<service>:<region>:<account>:<resource>`):
/// the same partition, service, region and account, and a resource that
/// starts like `arn`'s up to its last `/` (`event-bus/`, `stream/`) or is any
/// name. `None` when `arn` is not a full ARN.
pub(crate) fn same_account(arn: &str) -> Option<String> {
    let fields: Vec<&str> = arn.splitn(6, ':').collect();
    let [_arn @ "arn", partition, service, region, account, resource] = fields[..] else {
        return None;
    };
    if [partition, service, region, account]
        .iter()
        .any(|f| f.is_empty())
    {
        return None;
    }
    let kind = resource.rfind('/').map_or("", |i| &resource[..=i]);
    Some(format!(
        "arn:{partition}:{service}:{region}:{account}:{kind}*"
    ))
}

/// An AWS section's rules: `defaults` (those that can be derived), widened by
/// the operator's `allowed_destinations`.
pub(crate) fn aws(defaults: impl IntoIterator<Item = Option<String>>, extra: &[String]) -> Allowed {
    Allowed::patterns(defaults.into_iter().flatten().chain(extra.iter().cloned()))
}

/// Check each of an AWS section's `allowed_destinations` under `key`.
pub(crate) fn check_patterns(key: &str, patterns: &[String], bad: &mut dyn FnMut(&str, String)) {
    for pattern in patterns {
        if let Err(message) = check_pattern(pattern) {
            bad(key, message);
        }
    }
}

/// A character `*` may stand for: what AWS allows in a resource name.
fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

/// The longest name a rule is matched against: longer ones are refused
/// unread (no destination name AWS or a URL needs is near it).
pub(crate) const MAX_NAME: usize = 2048;

/// Whether `name` matches `pattern`, `*` standing for a run (possibly empty)
/// of [`name_char`]s and every other character for itself.
///
/// Linear in each segment's pattern times its name: the characters a `*`
/// cannot stand for split both into segments that must line up one to one,
/// and each segment is matched with the single-backtrack wildcard rule, so a
/// crafted name cannot make a pattern with several stars take long.
fn matches(pattern: &str, name: &str) -> bool {
    if name.len() > MAX_NAME {
        return false;
    }
    let separators = |text: &str, star: bool| -> Vec<char> {
        text.chars()
            .filter(|&c| !(name_char(c) || (star && c == '*')))
            .collect()
    };
    if separators(pattern, true) != separators(name, false) {
        return false;
    }
    let mut names = name.split(|c: char| !name_char(c));
    pattern
        .split(|c: char| !(name_char(c) || c == '*'))
        .all(|segment| {
            names
                .next()
                .is_some_and(|n| glob(segment.as_bytes(), n.as_bytes()))
        })
}

/// Wildcard match of one segment (`*` any run, every other byte itself).
fn glob(pattern: &[u8], name: &[u8]) -> bool {
    let (mut p, mut n) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, n));
            p += 1;
        } else if p < pattern.len() && pattern[p] == name[n] {
            p += 1;
            n += 1;
        } else if let Some((sp, sn)) = star {
            p = sp + 1;
            n = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&b| b == b'*')
}

/// Whether `pattern` can be used: a `*` only where a resource name goes.
pub(crate) fn check_pattern(pattern: &str) -> Result<(), String> {
    if pattern.is_empty() {
        return Err("an empty pattern".into());
    }
    if pattern.contains("**") {
        return Err(format!("{pattern:?}: `**` is not a pattern; `*` stands for one name's characters and never spans `:` or `/`"));
    }
    Ok(())
}

/// A template value for a URL path: everything but the unreserved
/// characters of RFC 3986 percent-encoded, so a value cannot add a path
/// segment, a query, a fragment, or reach the host; `.` and `..` (which a
/// server resolves as "this" and "the parent" segment) are refused.
pub(crate) fn encode_path_value(value: &str) -> Result<String, String> {
    if value == "." || value == ".." {
        return Err(format!(
            "the value {value:?} would climb the URL's path; a template value may not be . or .."
        ));
    }
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    Ok(out)
}

/// Where the first placeholder of a URL template may stand: in the path,
/// after the origin's `/` and before any `?` or `#`. `Err` says why not.
pub(crate) fn check_url_template(template: &str) -> Result<(), String> {
    let (Some(first), Some(last)) = (template.find('{'), template.rfind('{')) else {
        return Ok(());
    };
    let after_scheme = template.find("://").map_or(0, |i| i + 3);
    let path = template[after_scheme..].find('/').map(|i| after_scheme + i);
    let query = template.find(['?', '#']).unwrap_or(template.len());
    match path {
        Some(path) if path < first && last < query => Ok(()),
        _ => Err(format!(
            "placeholders may stand only in the URL's path (after scheme://host[:port]/ and before any ? or #): {template:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_star_stands_for_one_name_and_never_spans_a_colon_or_a_slash() {
        let p = "arn:aws:sns:eu-west-1:123456789012:*";
        assert!(matches(p, "arn:aws:sns:eu-west-1:123456789012:orders.fifo"));
        assert!(matches(p, "arn:aws:sns:eu-west-1:123456789012:"));
        assert!(!matches(p, "arn:aws:sns:eu-west-1:123456789012:a:b"));
        assert!(!matches(p, "arn:aws:sns:eu-west-1:999999999999:orders"));
        assert!(!matches(p, "arn:aws:sns:us-east-1:123456789012:orders"));
        let q = "https://sqs.eu-west-1.amazonaws.com/123456789012/*";
        assert!(matches(
            q,
            "https://sqs.eu-west-1.amazonaws.com/123456789012/q-1"
        ));
        assert!(!matches(
            q,
            "https://sqs.eu-west-1.amazonaws.com/123456789012/q/../x"
        ));
        assert!(!matches(
            q,
            "https://sqs.eu-west-1.amazonaws.com/123456789012/q?Action=x"
        ));
        assert!(matches(
            "arn:aws:sns:*:123456789012:orders-*",
            "arn:aws:sns:us-east-1:123456789012:orders-eu"
        ));
        assert!(matches("*", "orders"));
        assert!(!matches("*", "arn:aws:kinesis:r:1:stream/x"));
        assert!(matches("exact", "exact") && !matches("exact", "exactly"));
        assert!(matches("a*b*c", "aXXbYYc") && !matches("a*b*c", "aXXbYY"));
        assert!(matches("orders-*-eu", "orders--eu") && !matches("orders-*-eu", "orders-eu"));
    }

    #[test]
    fn a_crafted_name_cannot_make_several_stars_slow() {
        let pattern = "arn:aws:sns:eu-west-1:123456789012:*-*-*-*-orders-*";
        let name = format!(
            "arn:aws:sns:eu-west-1:123456789012:{}:",
            "-orders-".repeat(250)
        );
        let started = std::time::Instant::now();
        for _ in 0..100 {
            assert!(!matches(pattern, &name));
        }
        assert!(!matches("*", &"a".repeat(MAX_NAME + 1)), "too long to read");
        // Not a timing assertion on the result: a quadratic matcher takes
        // seconds on one such name; this prints what the linear one takes.
        eprintln!("100 crafted names in {:?}", started.elapsed());
    }

    #[test]
    fn the_configured_arn_gives_its_partition_region_and_account() {
        assert_eq!(
            same_account("arn:aws:sns:eu-west-1:123456789012:orders.fifo").as_deref(),
            Some("arn:aws:sns:eu-west-1:123456789012:*")
        );
        assert_eq!(
            same_account("arn:aws-cn:events:cn-north-1:123456789012:event-bus/orders").as_deref(),
            Some("arn:aws-cn:events:cn-north-1:123456789012:event-bus/*")
        );
        assert_eq!(same_account("orders"), None);
        assert_eq!(same_account("arn:aws:sns::123:x"), None);
        let allowed = aws(
            [same_account("arn:aws:kinesis:us-east-1:1:stream/s"), None],
            &["arn:aws:kinesis:us-east-1:2:stream/audit".into()],
        );
        assert!(allowed
            .check("arn:aws:kinesis:us-east-1:1:stream/other")
            .is_ok());
        assert!(allowed
            .check("arn:aws:kinesis:us-east-1:2:stream/audit")
            .is_ok());
        assert!(allowed
            .check("arn:aws:kinesis:us-east-1:2:stream/other")
            .is_err());
    }

    #[test]
    fn an_origin_is_scheme_host_and_port_and_nothing_else_passes() {
        let allowed = Allowed::origins(["https://hooks.example.com/in"]).unwrap();
        for ok in [
            "https://hooks.example.com/other/path?x=1",
            "https://HOOKS.example.com:443/",
        ] {
            assert_eq!(allowed.check(ok), Ok(()), "{ok}");
        }
        for refused in [
            "http://hooks.example.com/in",
            "https://hooks.example.com:8443/in",
            "https://hooks.example.com.evil.test/in",
            "https://hooks.example.com@127.0.0.1/admin",
            "http://127.0.0.1:9187/metrics",
            "http://169.254.169.254/latest/meta-data/",
            "file:///etc/passwd",
            "not a url",
        ] {
            let why = allowed.check(refused).unwrap_err();
            assert!(
                why.contains("origin https://hooks.example.com:443"),
                "{why}"
            );
        }
        assert!(Allowed::default()
            .check("https://x.test/")
            .unwrap_err()
            .contains("may name none"));
    }

    #[test]
    fn template_values_cannot_leave_the_path_segment() {
        let encode = |v| encode_path_value(v).unwrap();
        assert_eq!(encode("order.v2"), "order.v2");
        assert_eq!(encode("evil.example/"), "evil.example%2F");
        assert_eq!(encode("a?b#c@d:e %"), "a%3Fb%23c%40d%3Ae%20%25");
        assert!(encode_path_value("..").is_err() && encode_path_value(".").is_err());
        assert!(check_url_template("https://h.test/{aggregate_type}/{event_type}").is_ok());
        assert!(check_url_template("https://h.test/in").is_ok());
        for bad in [
            "https://{aggregate_type}.h.test/",
            "https://h.test{event_type}/",
            "https://h.test/in?type={event_type}",
            "https://h.test/in#{event_type}",
            "https://h.test/{aggregate_type}?t={event_type}",
            "{aggregate_type}",
        ] {
            assert!(check_url_template(bad).is_err(), "{bad}");
        }
    }
}

//! Where a service's requests go.
//!
//! The order is the AWS SDK's: the relay's own key for the service (e.g.
//! `sns.endpoint_url`); else `AWS_ENDPOINT_URL_<SERVICE>` or a profile's
//! `services` section; else `AWS_ENDPOINT_URL` or a profile's `endpoint_url`
//! (all ignored under `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`); else the
//! service's own rules for the region, which the destination supplies.

use aws_config::SdkConfig;
use hyper::header::HeaderValue;
use hyper::Uri;

use super::Service;

/// The endpoint set for `service`, and the key or variable that set it:
/// `explicit` (the relay's key and its value, empty when unset), else the
/// SDK's settings. `None`: nothing is set; the service's rules decide.
pub(crate) fn configured(
    sdk: &SdkConfig,
    service: &Service,
    explicit: (&'static str, &str),
) -> Option<(&'static str, String)> {
    let (key, url) = explicit;
    if !url.is_empty() {
        return Some((key, url.to_owned()));
    }
    let service_key = aws_types::service_config::ServiceConfigKey::builder()
        .service_id(service.service_id)
        .env("AWS_ENDPOINT_URL")
        .profile("endpoint_url")
        .build()
        .expect("every part of the key is set");
    if let Some(url) = sdk
        .service_config()
        .and_then(|c| c.load_config(service_key))
    {
        return Some((service.endpoint_variable, url));
    }
    sdk.endpoint_url()
        .map(|url| ("AWS_ENDPOINT_URL", url.to_owned()))
}

/// The endpoint of an S3 `bucket`: a configured one ([`configured`], with
/// `explicit`) path-style (`<endpoint>/<bucket>`, as local and compatible
/// endpoints take it); else AWS's own, virtual-hosted
/// (`https://<bucket>.s3.<region>.amazonaws.com`), named by `bucket_key`.
pub(crate) fn s3_bucket(
    sdk: &SdkConfig,
    region: &str,
    explicit: (&'static str, &str),
    bucket: &str,
    bucket_key: &'static str,
) -> (&'static str, String) {
    match configured(sdk, &super::S3, explicit) {
        Some((key, url)) => (key, format!("{}/{bucket}", url.trim_end_matches('/'))),
        None => {
            let suffix = if region.starts_with("cn-") {
                "amazonaws.com.cn"
            } else {
                "amazonaws.com"
            };
            (bucket_key, format!("https://{bucket}.s3.{region}.{suffix}"))
        }
    }
}

/// The ARN partition of `region` (`aws`, `aws-cn`, `aws-us-gov`, …).
pub(crate) fn partition(region: &str) -> &'static str {
    match region {
        r if r.starts_with("cn-") => "aws-cn",
        r if r.starts_with("us-gov-") => "aws-us-gov",
        r if r.starts_with("us-isob-") => "aws-iso-b",
        r if r.starts_with("us-isof-") => "aws-iso-f",
        r if r.starts_with("us-iso-") => "aws-iso",
        r if r.starts_with("eu-isoe-") => "aws-iso-e",
        r if r.starts_with("eusc-") => "aws-eusc",
        _ => "aws",
    }
}

/// The endpoint AWS's rules give `prefix` (`sqs`, `events`, `kinesis`) in
/// `region`: `https://<prefix>[-fips].<region>.<partition's DNS suffix>`, or
/// the dual-stack `api.aws` names. The same rules the SDKs' resolvers apply
/// to these services for a region (the relay does not compile three SDK
/// crates for them; SNS keeps its SDK's resolver, already in the tree).
pub(crate) fn regional(prefix: &str, region: &str, fips: bool, dual_stack: bool) -> String {
    let (suffix, dual_suffix) = match region {
        r if r.starts_with("cn-") => ("amazonaws.com.cn", "api.amazonwebservices.com.cn"),
        r if r.starts_with("us-isob-") => ("sc2s.sgov.gov", "sc2s.sgov.gov"),
        r if r.starts_with("us-isof-") => ("csp.hci.ic.gov", "csp.hci.ic.gov"),
        r if r.starts_with("us-iso-") => ("c2s.ic.gov", "c2s.ic.gov"),
        r if r.starts_with("eu-isoe-") => ("cloud.adc-e.uk", "cloud.adc-e.uk"),
        r if r.starts_with("eusc-") => ("amazonaws.eu", "api.amazonwebservices.eu"),
        _ => ("amazonaws.com", "api.aws"),
    };
    let name = if fips {
        format!("{prefix}-fips")
    } else {
        prefix.to_owned()
    };
    let suffix = if dual_stack { dual_suffix } else { suffix };
    format!("https://{name}.{region}.{suffix}")
}

/// The endpoint of `service` for a sink: configured ([`configured`], with
/// the sink's own `explicit` key), else [`regional`] for `prefix` with the
/// FIPS and dual-stack settings of `sdk`. With the key that set it.
pub(crate) fn for_service(
    sdk: &SdkConfig,
    service: &Service,
    explicit: (&'static str, &str),
    prefix: &str,
    region: &str,
    region_key: &'static str,
) -> (&'static str, String) {
    configured(sdk, service, explicit).unwrap_or_else(|| {
        (
            region_key,
            regional(
                prefix,
                region,
                sdk.use_fips().unwrap_or(false),
                sdk.use_dual_stack().unwrap_or(false),
            ),
        )
    })
}

/// An endpoint URL taken apart for requests.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    /// As the operator wrote it, for messages.
    pub text: String,
    /// The URI requests are signed for and sent to: scheme, authority
    /// without a default port, path.
    pub uri: Uri,
    /// The `Host` header (signed).
    pub host: HeaderValue,
}

impl Endpoint {
    /// `url` (`http://` or `https://`, a host, an optional port and path,
    /// no query), or why it cannot be used.
    pub(crate) fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url.parse().map_err(|e| format!("{e}"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err("it must start with http:// or https://".into()),
        };
        let given = uri.authority().ok_or("it has no host")?.clone();
        let host = given.host().trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err("it has no host".into());
        }
        if https {
            rustls::pki_types::ServerName::try_from(host)
                .map_err(|e| format!("{host:?} is not a TLS server name: {e}"))?;
        }
        let default_port = if https { 443 } else { 80 };
        let port = given.port_u16().unwrap_or(default_port);
        // `Host` (signed) and the URI without a default port, as the SDK
        // sends them: a proxy that normalises `Host` keeps the signature.
        let bracketed = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        let authority = if port == default_port {
            bracketed
        } else {
            format!("{bracketed}:{port}")
        };
        if uri.query().is_some() {
            return Err("it must not have a query".into());
        }
        let path = match uri.path() {
            "" => "/",
            path => path,
        };
        let uri = Uri::builder()
            .scheme(if https { "https" } else { "http" })
            .authority(authority.as_str())
            .path_and_query(path)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            text: url.to_owned(),
            uri,
            host: HeaderValue::from_str(&authority).map_err(|e| e.to_string())?,
        })
    }

    /// Whether requests go over TLS.
    pub(crate) fn is_https(&self) -> bool {
        self.uri.scheme_str() == Some("https")
    }

    /// The URI of `key` under the endpoint's path (the path itself when
    /// `key` is empty).
    pub(crate) fn join(&self, key: &str) -> Result<Uri, String> {
        if key.is_empty() {
            return Ok(self.uri.clone());
        }
        let base = self.uri.to_string();
        format!("{}/{key}", base.trim_end_matches('/'))
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn regional_endpoints_match_the_sdk_resolver_of_sns_in_every_partition() {
        use aws_sdk_sns::config::endpoint::{DefaultResolver, Params, ResolveEndpoint as _};
        for region in [
            "us-east-1",
            "eu-west-1",
            "ap-southeast-5",
            "cn-north-1",
            "us-gov-west-1",
            "us-iso-east-1",
            "us-isob-east-1",
        ] {
            for (fips, dual_stack) in [(false, false), (false, true), (true, false)] {
                if fips && region.starts_with("us-gov-") {
                    continue; // SNS's GovCloud endpoints are FIPS ones already
                }
                if (fips || dual_stack) && region.starts_with("us-iso") {
                    continue; // neither exists there
                }
                let params = Params::builder()
                    .region(region)
                    .use_fips(fips)
                    .use_dual_stack(dual_stack)
                    .build()
                    .unwrap();
                let sdk = DefaultResolver::new().resolve_endpoint(&params).await;
                let Ok(sdk) = sdk else { continue };
                assert_eq!(
                    regional("sns", region, fips, dual_stack),
                    sdk.url(),
                    "{region} fips={fips} dual_stack={dual_stack}"
                );
            }
        }
    }

    #[test]
    fn endpoints_are_parsed_with_their_host_header() {
        let e = Endpoint::parse("http://127.0.0.1:5000").unwrap();
        assert_eq!(e.uri, "http://127.0.0.1:5000/");
        assert_eq!(e.host, "127.0.0.1:5000");
        assert!(!e.is_https());
        let e = Endpoint::parse("https://sns.eu-west-1.amazonaws.com:443").unwrap();
        assert_eq!(e.uri, "https://sns.eu-west-1.amazonaws.com/");
        assert_eq!(e.host, "sns.eu-west-1.amazonaws.com");
        assert!(e.is_https());
        let e = Endpoint::parse("http://[::1]:4566/sns").unwrap();
        assert_eq!(e.uri, "http://[::1]:4566/sns");
        assert_eq!(e.host, "[::1]:4566");
        assert_eq!(e.join("k").unwrap(), "http://[::1]:4566/sns/k");
        assert!(Endpoint::parse("localhost:4566").is_err());
        assert!(Endpoint::parse("ftp://x").is_err());
        assert!(Endpoint::parse("http://x/?a=b").is_err());
    }

    #[test]
    fn a_configured_endpoint_goes_before_the_services_rules() {
        let sdk = SdkConfig::builder()
            .endpoint_url("http://localhost:4566")
            .build();
        assert_eq!(
            configured(
                &sdk,
                &super::super::SNS,
                ("sns.endpoint_url", "http://127.0.0.1:5000")
            ),
            Some(("sns.endpoint_url", "http://127.0.0.1:5000".to_owned()))
        );
        assert_eq!(
            configured(&sdk, &super::super::SNS, ("sns.endpoint_url", "")),
            Some(("AWS_ENDPOINT_URL", "http://localhost:4566".to_owned()))
        );
        assert_eq!(
            configured(&SdkConfig::builder().build(), &super::super::SNS, ("k", "")),
            None
        );
        assert_eq!(
            s3_bucket(&sdk, "eu-west-1", ("k", ""), "b", "bucket"),
            ("AWS_ENDPOINT_URL", "http://localhost:4566/b".to_owned())
        );
        assert_eq!(
            s3_bucket(
                &SdkConfig::builder().build(),
                "cn-north-1",
                ("k", ""),
                "b",
                "bucket"
            ),
            (
                "bucket",
                "https://b.s3.cn-north-1.amazonaws.com.cn".to_owned()
            )
        );
    }
}

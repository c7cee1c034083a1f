//! Who a request comes from ([`ClientKey`], the controller's own client keys)
//! and who the controller acts for when it calls a worker ([`Acting`]: the
//! `x-pie-client` headers a worker trusts from the controller's worker key).

use pie_core::auth::{
    KeyLimits, Role, ACT_AS_CACHE_SALT, ACT_AS_CLIENT, ACT_AS_LIMITS, ACT_AS_ROLE,
};

/// The client key that authenticated a request (absent when the controller
/// has no keys: then every caller may do everything).
#[derive(Clone, Debug)]
pub struct ClientKey {
    pub name: String,
    pub role: Role,
    pub limits: KeyLimits,
}

/// Who a forwarded request is for, as the worker learns it from the
/// `x-pie-client` headers (it trusts them from the controller's worker key).
#[derive(Clone)]
pub struct Acting {
    pub client: String,
    pub role: Role,
    pub cache_salt: Option<String>,
    /// A client key's limits, as JSON (see [`ACT_AS_LIMITS`]).
    pub limits: Option<String>,
}

impl Acting {
    /// `req` with the act-as headers.
    pub fn apply(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let req = req
            .header(ACT_AS_CLIENT, &self.client)
            .header(ACT_AS_ROLE, self.role.as_str());
        let req = match &self.limits {
            Some(limits) => req.header(ACT_AS_LIMITS, limits),
            None => req,
        };
        match &self.cache_salt {
            Some(salt) => req.header(ACT_AS_CACHE_SALT, salt),
            None => req,
        }
    }
}

/// Without client keys the controller is open: its callers act as admin.
pub fn acting_as(key: Option<&ClientKey>) -> Acting {
    match key {
        Some(k) => Acting {
            client: k.name.clone(),
            role: k.role,
            cache_salt: k.limits.cache_salt.clone(),
            limits: (k.role == Role::Client).then(|| forwarded_limits(&k.limits)),
        },
        None => Acting {
            client: "anonymous".to_string(),
            role: Role::Admin,
            cache_salt: None,
            limits: None,
        },
    }
}

/// A client key's limits as the worker gets them: JSON without the cache
/// salt (which has its own header and may not be header-safe text).
fn forwarded_limits(limits: &KeyLimits) -> String {
    let limits = KeyLimits {
        cache_salt: None,
        ..limits.clone()
    };
    serde_json::to_string(&limits).unwrap_or_default()
}

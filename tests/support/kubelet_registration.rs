//! How the kubelet double registers a plugin, as the kubelet's plugin manager does: it waits for the
//! registration socket, dials it by raw path, checks the `GetInfo` answer, chooses the DRA service and
//! tells the plugin the verdict, retrying with the kubelet's backoff where the kubelet would.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use super::{
    dra_client, error_chain, with_deadline, Dial, DraService, KubeletDouble, KubeletError,
    PluginInfo, CALL_TIMEOUT, SERVICES_SUPPORTED_BY_KUBELET,
};
use crate::proto::pluginregistration::registration_client::RegistrationClient;
use crate::proto::pluginregistration::{InfoRequest, RegistrationStatus};
use crate::proto::{DRA_PLUGIN_TYPE, DRA_V1BETA1_SERVICE, DRA_V1_SERVICE};
use crate::support::grpc_dial::{unix_connector, UNIX_TARGET_URI};

/// The kubelet dials the registration socket in blocking mode with this timeout.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
const GET_INFO_TIMEOUT: Duration = Duration::from_secs(1);
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// The kubelet learns of new sockets through fsnotify; polling this often keeps registration about as prompt.
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// The kubelet retries a failed registration with exponential backoff (`exponentialbackoff`: 500 ms,
/// doubling, at most 2 min 2 s).
const RETRY_INITIAL: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(122);

impl DraService {
    /// Maps a `supported_versions` entry to a service this double can speak.
    fn from_registration(entry: &str) -> Option<Self> {
        match entry {
            DRA_V1_SERVICE => Some(Self::V1),
            DRA_V1BETA1_SERVICE => Some(Self::V1beta1),
            _ => None,
        }
    }
}

impl KubeletDouble {
    /// Waits up to `timeout` for `<registry_dir>/<driver>-reg.sock` and registers the plugin behind it, choosing
    /// among the services a 1.34 – 1.37 kubelet supports. Like the kubelet's reconciler, an attempt that fails
    /// before a verdict (dial, GetInfo, notify) is retried with the kubelet's exponential backoff until `timeout`
    /// has passed; then the last error is returned. A rejection is returned at once: the kubelet would only repeat
    /// it.
    pub async fn register(
        registry_dir: &Path,
        driver: &str,
        timeout: Duration,
    ) -> Result<Self, KubeletError> {
        Self::register_with(
            registry_dir,
            driver,
            timeout,
            &SERVICES_SUPPORTED_BY_KUBELET,
        )
        .await
    }

    /// Like [`register`](Self::register), for a kubelet that supports only the `supported` services
    /// (e.g. `&["v1beta1.DRAPlugin"]` for an older kubelet).
    pub async fn register_with(
        registry_dir: &Path,
        driver: &str,
        timeout: Duration,
        supported: &[&str],
    ) -> Result<Self, KubeletError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let socket = wait_for_registration_socket(registry_dir, driver, timeout).await?;
        let mut backoff = RETRY_INITIAL;
        loop {
            let error = match Self::register_once(&socket, supported).await {
                Ok(kubelet) => return Ok(kubelet),
                Err(error @ KubeletError::Rejected(_)) => return Err(error),
                Err(error) => error,
            };
            if tokio::time::Instant::now() + backoff >= deadline {
                return Err(error);
            }
            tracing::debug!(%error, ?backoff, "RegisterPlugin failed; retrying like the kubelet");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RETRY_MAX);
        }
    }

    /// One RegisterPlugin operation of the kubelet's plugin manager on `socket`
    /// (`operation_generator.go`): dial by raw path, GetInfo within 1 s, validate, connect to the DRA
    /// socket, NotifyRegistrationStatus; the registration connection is closed at the end.
    pub async fn register_once(socket: &Path, supported: &[&str]) -> Result<Self, KubeletError> {
        let channel = dial_registration_socket(socket).await?;
        let mut registration = RegistrationClient::new(channel);

        let info = with_deadline(
            GET_INFO_TIMEOUT,
            |request| registration.get_info(request),
            InfoRequest {},
        )
        .await
        .map_err(KubeletError::GetInfo)?;

        let (service, endpoint) = match validate(&info, socket, supported) {
            Ok(chosen) => chosen,
            Err(reason) => {
                let status = RegistrationStatus {
                    plugin_registered: false,
                    error: reason.clone(),
                };
                // A failed notification changes the kubelet's log line, not the outcome: the plugin is not
                // registered either way.
                if let Err(status) = with_deadline(
                    NOTIFY_TIMEOUT,
                    |r| registration.notify_registration_status(r),
                    status,
                )
                .await
                {
                    tracing::warn!(%status, "NotifyRegistrationStatus(false) failed");
                }
                return Err(KubeletError::Rejected(reason));
            }
        };

        // Like the kubelet's grpc.NewClient("unix:" + endpoint) + Connect(): the connection is made in the
        // background, so a DRA socket that is not up yet fails the first calls, not the registration.
        let (channel, client) = dra_client(&endpoint, service, Dial::UnixScheme);

        let registered = RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        };
        with_deadline(
            NOTIFY_TIMEOUT,
            |r| registration.notify_registration_status(r),
            registered,
        )
        .await
        .map_err(KubeletError::Notify)?;
        tracing::debug!(driver = %info.name, endpoint = %endpoint.display(), ?service, "DRA plugin registered");

        Ok(Self {
            info,
            endpoint,
            channel,
            client,
            call_timeout: CALL_TIMEOUT,
        })
    }
}

/// Polls `registry_dir` until the plugin's registration socket shows up. Like the kubelet's plugin watcher it
/// ignores hidden names and anything that is not a socket (a stale regular file, say).
async fn wait_for_registration_socket(
    registry_dir: &Path,
    driver: &str,
    timeout: Duration,
) -> Result<PathBuf, KubeletError> {
    let wanted = format!("{driver}-reg.sock");
    let socket = registry_dir.join(&wanted);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if registration_socket_present(registry_dir, &wanted) {
            return Ok(socket);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(KubeletError::Timeout {
                socket,
                waited: timeout,
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

fn registration_socket_present(registry_dir: &Path, wanted: &str) -> bool {
    // A directory that does not exist yet is simply empty: the plugin may create it after we start watching.
    let Ok(entries) = std::fs::read_dir(registry_dir) else {
        return false;
    };
    entries.flatten().any(|entry| {
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return false;
        };
        // The kubelet stats the path (following symlinks) before checking that it is a socket.
        !name.starts_with('.')
            && name == wanted
            && std::fs::metadata(entry.path()).is_ok_and(|meta| meta.file_type().is_socket())
    })
}

/// Dials like the kubelet's blocking dial: retries until it connects or the 10 s dial timeout ends, because the
/// socket file can exist a moment before the plugin accepts on it.
async fn dial_registration_socket(socket: &Path) -> Result<Channel, KubeletError> {
    let endpoint = Endpoint::from_static(UNIX_TARGET_URI);
    let deadline = tokio::time::Instant::now() + DIAL_TIMEOUT;
    loop {
        let attempt = tokio::time::timeout_at(
            deadline,
            endpoint.connect_with_connector(unix_connector(socket, Dial::RawPath)),
        )
        .await;
        let reason = match attempt {
            Ok(Ok(channel)) => return Ok(channel),
            Ok(Err(error)) => error_chain(&error),
            Err(_) => format!("no connection within {DIAL_TIMEOUT:?}"),
        };
        if tokio::time::Instant::now() + POLL_INTERVAL >= deadline {
            return Err(KubeletError::Transport {
                socket: socket.to_path_buf(),
                reason,
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// The kubelet's checks on a `GetInfo` answer (`GenerateRegisterPluginFunc` and the DRA handler's
/// `ValidatePlugin`); returns the chosen service and the DRA socket, or the reason it sends back in
/// `NotifyRegistrationStatus`, worded as the kubelet words it. The kubelet takes the plugin's name as it
/// comes (nothing ties it to the socket's file name) and does not check the endpoint: a relative one
/// registers and then fails to connect.
fn validate(
    info: &PluginInfo,
    registration_socket: &Path,
    supported: &[&str],
) -> Result<(DraService, PathBuf), String> {
    if info.r#type != DRA_PLUGIN_TYPE {
        return Err(format!(
            "RegisterPlugin error -- no handler registered for plugin type: {} at socket {}",
            info.r#type,
            registration_socket.display()
        ));
    }
    let endpoint = if info.endpoint.is_empty() {
        registration_socket.to_path_buf()
    } else {
        PathBuf::from(&info.endpoint)
    };
    let invalid = |why: String| {
        format!(
            "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA \
             driver plugin {} at endpoint {}: {why}",
            info.name,
            endpoint.display()
        )
    };
    if info.supported_versions.is_empty() {
        return Err(invalid(
            "empty list of supported gRPC services (aka supported versions)".to_string(),
        ));
    }
    // The plugin's order decides, not the kubelet's: the first entry the kubelet supports wins.
    let service = info
        .supported_versions
        .iter()
        .filter(|entry| supported.contains(&entry.as_str()))
        .find_map(|entry| DraService::from_registration(entry));
    match service {
        Some(service) => Ok((service, endpoint)),
        None => Err(invalid(format!(
            "none of services supported by the plugin ({}) are supported by the kubelet ({})",
            go_quoted_list(&info.supported_versions),
            go_quoted_list(supported)
        ))),
    }
}

/// A string list as Go's `%q` prints it: `["a" "b"]`.
fn go_quoted_list<S: AsRef<str>>(items: &[S]) -> String {
    let quoted: Vec<String> = items
        .iter()
        .map(|item| format!("{:?}", item.as_ref()))
        .collect();
    format!("[{}]", quoted.join(" "))
}

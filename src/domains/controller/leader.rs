//! Leader election over a `coordination.k8s.io/v1` Lease, so that the controller can run as several
//! replicas of which one works: [`LeaderElector::run`] waits until it holds the Lease, runs the work
//! while it keeps it, and stops the work at once when it cannot renew within the renew deadline.
//!
//! The semantics are client-go's (`tools/leaderelection`): a candidate takes the Lease when it does not
//! exist (create), when it is its own, when it has no holder (released), or when the record has not
//! changed for `leaseDurationSeconds` of the candidate's *own* clock since it last saw it change; the
//! remote `renewTime` is never compared with the local clock, so clock skew between replicas does not
//! matter, only their rates. Every write is an update guarded by the resourceVersion just read: of two
//! candidates writing the same record, the second gets a conflict and stays a candidate.
//!
//! The holder stops leading when a renew deadline has passed since the last renewal that succeeded
//! (counted from when that request was sent, which is before any other replica could have seen it), and
//! the renew deadline is shorter than the lease duration: the work has stopped before another replica
//! may take the Lease. On a graceful stop the holder asks the work to end, waits for it while it keeps
//! renewing, then releases the Lease (holder cleared, as client-go's `ReleaseOnCancel`), so another
//! replica takes over at its next try rather than after the lease duration.
//!
//! ```ignore
//! let elector = LeaderElector::new(client.clone(), LeaderElectionConfig::new("gpu-dra", "gpu-dra-controller", identity))?;
//! elector.run(|stop| Controller::new(client, config).run(stop.requested()), sigterm).await?;
//! ```

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use thiserror::Error;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// client-go's and NVIDIA's defaults (`LeaseDuration`, `RenewDeadline`, `RetryPeriod`).
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
pub const DEFAULT_RENEW_DEADLINE: Duration = Duration::from_secs(10);
pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);
/// The Lease's default name.
pub const DEFAULT_LEASE_NAME: &str = "gpu-dra-controller";

/// Timings that cannot work; the messages name the flags of `gpu-dra controller` that set them.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TimingError {
    #[error("--leader-elect-{0} must be longer than zero")]
    Zero(&'static str),
    #[error("--leader-elect-renew-deadline ({renew:?}) must be shorter than --leader-elect-lease-duration ({lease:?}): the leader must stop before another replica may take the Lease")]
    RenewNotShorterThanLease { renew: Duration, lease: Duration },
    #[error("--leader-elect-retry-period ({retry:?}) must be shorter than --leader-elect-renew-deadline ({renew:?}): the leader must be able to try again before it gives up")]
    RetryNotShorterThanRenew { retry: Duration, renew: Duration },
}

/// Why a replica stopped leading without being asked to.
#[derive(Debug, Error)]
pub enum LeaderError {
    #[error("lost the Lease {lease}: not renewed within the renew deadline ({deadline:?}); last error: {last_error}")]
    NotRenewed {
        lease: String,
        deadline: Duration,
        last_error: String,
    },
    #[error("lost the Lease {lease}: {holder} holds it now")]
    TakenOver { lease: String, holder: String },
}

/// How [`LeaderElector::run`] ended when it did not lose the Lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Shutdown came: before this replica led, or while it led (the work then ended and the Lease was
    /// released).
    Shutdown,
    /// The work returned on its own while this replica led; the Lease was released.
    WorkReturned,
}

/// Which Lease, who this replica is, and the timings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderElectionConfig {
    pub lease_namespace: String,
    pub lease_name: String,
    /// Unique per process: `<pod name>_<random>`, so a restarted Pod is a new candidate.
    pub identity: String,
    /// How long the others wait, on their own clocks, after they last saw the record change before they
    /// take the Lease. Written in whole seconds (rounded up).
    pub lease_duration: Duration,
    /// How long the leader keeps working without a successful renewal.
    pub renew_deadline: Duration,
    /// How often a candidate tries to take the Lease, and the leader renews it.
    pub retry_period: Duration,
}

impl LeaderElectionConfig {
    /// The default timings.
    pub fn new(lease_namespace: &str, lease_name: &str, identity: &str) -> Self {
        LeaderElectionConfig {
            lease_namespace: lease_namespace.to_string(),
            lease_name: lease_name.to_string(),
            identity: identity.to_string(),
            lease_duration: DEFAULT_LEASE_DURATION,
            renew_deadline: DEFAULT_RENEW_DEADLINE,
            retry_period: DEFAULT_RETRY_PERIOD,
        }
    }

    /// Renew deadline shorter than the lease duration, retry period shorter than the renew deadline.
    pub fn check(&self) -> Result<(), TimingError> {
        for (name, value) in [
            ("lease-duration", self.lease_duration),
            ("renew-deadline", self.renew_deadline),
            ("retry-period", self.retry_period),
        ] {
            if value.is_zero() {
                return Err(TimingError::Zero(name));
            }
        }
        if self.renew_deadline >= self.lease_duration {
            return Err(TimingError::RenewNotShorterThanLease {
                renew: self.renew_deadline,
                lease: self.lease_duration,
            });
        }
        if self.retry_period >= self.renew_deadline {
            return Err(TimingError::RetryNotShorterThanRenew {
                retry: self.retry_period,
                renew: self.renew_deadline,
            });
        }
        Ok(())
    }

    /// `leaseDurationSeconds`: whole seconds, rounded up so that the others never wait less than the
    /// leader assumes.
    fn lease_seconds(&self) -> i32 {
        let millis = self.lease_duration.as_millis().div_ceil(1000);
        i32::try_from(millis).unwrap_or(i32::MAX)
    }
}

/// Completes when the elector asks the work to end (a graceful stop); the work should then finish what
/// it is doing and return.
pub struct StopRequest(watch::Receiver<bool>);

impl StopRequest {
    pub async fn requested(mut self) {
        // An error means the elector is gone, which asks for a stop as well.
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// The record as last read and when this replica saw it change (its own clock).
struct Observed {
    lease: Lease,
    since: Instant,
}

/// One try to take or renew the Lease.
enum Attempt {
    Holding,
    /// Another replica holds a Lease that has not expired on this replica's clock; when it will.
    HeldBy {
        holder: String,
        expires: Instant,
    },
    Failed(String),
}

/// A candidate for one Lease; see the module documentation.
pub struct LeaderElector {
    leases: Api<Lease>,
    config: LeaderElectionConfig,
    observed: Option<Observed>,
}

impl LeaderElector {
    pub fn new(client: kube::Client, config: LeaderElectionConfig) -> Result<Self, TimingError> {
        config.check()?;
        Ok(LeaderElector {
            leases: Api::namespaced(client, &config.lease_namespace),
            config,
            observed: None,
        })
    }

    fn describe(&self) -> String {
        format!("{}/{}", self.config.lease_namespace, self.config.lease_name)
    }

    /// Waits until this replica holds the Lease, then runs `work` while it keeps it.
    ///
    /// Returns `Ok` when `shutdown` completes (before leading, or while leading once the work has ended
    /// and the Lease is released) or when the work returns on its own; `Err` when the Lease was lost,
    /// in which case the work was dropped at that moment, wherever it was.
    pub async fn run<W, F>(
        mut self,
        work: W,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Ended, LeaderError>
    where
        W: FnOnce(StopRequest) -> F,
        F: Future<Output = ()>,
    {
        tokio::pin!(shutdown);
        let lease = self.describe();
        info!(lease = %lease, identity = %self.config.identity, "waiting to lead");
        let acquired = tokio::select! {
            biased;
            () = &mut shutdown => None,
            renewed_at = self.acquire() => Some(renewed_at),
        };
        let Some(renewed_at) = acquired else {
            // A write sent as the shutdown came may have made this replica the holder.
            self.release().await;
            return Ok(Ended::Shutdown);
        };
        info!(lease = %lease, identity = %self.config.identity, "leading");

        let (stop, stop_requested) = watch::channel(false);
        let ended = {
            let work = work(StopRequest(stop_requested));
            let keep = self.keep(renewed_at);
            tokio::pin!(work, keep);
            let mut stopping = false;
            loop {
                tokio::select! {
                    biased;
                    // First: a lost Lease drops the work before it is polled again.
                    lost = &mut keep => {
                        warn!(lease = %lease, error = %lost, "stopped leading");
                        return Err(lost);
                    }
                    () = &mut work => break if stopping { Ended::Shutdown } else { Ended::WorkReturned },
                    () = &mut shutdown, if !stopping => {
                        info!(lease = %lease, "stopping: the work ends, then the Lease is released");
                        stopping = true;
                        let _ = stop.send(true);
                    }
                }
            }
        };
        self.release().await;
        Ok(ended)
    }

    /// Tries every retry period, and again at the moment the Lease it sees expires, until it holds the
    /// Lease; returns when the successful write was sent.
    async fn acquire(&mut self) -> Instant {
        loop {
            let sent = Instant::now();
            let next = match self.try_acquire_or_renew().await {
                Attempt::Holding => return sent,
                Attempt::HeldBy { holder, expires } => {
                    debug!(lease = %self.describe(), %holder, "the Lease is held");
                    expires.max(Instant::now())
                }
                Attempt::Failed(error) => {
                    debug!(lease = %self.describe(), %error, "could not take the Lease");
                    Instant::now() + self.config.retry_period
                }
            };
            tokio::time::sleep_until(next.min(Instant::now() + self.config.retry_period)).await;
        }
    }

    /// Renews every retry period; returns (never `Ok`) once the Lease is lost: no renewal succeeded
    /// within the renew deadline, or another replica holds it.
    async fn keep(&mut self, mut renewed_at: Instant) -> LeaderError {
        let mut last_error = String::from("none");
        loop {
            let deadline = renewed_at + self.config.renew_deadline;
            tokio::time::sleep_until((Instant::now() + self.config.retry_period).min(deadline))
                .await;
            let sent = Instant::now();
            if sent >= deadline {
                return self.not_renewed(last_error);
            }
            match tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await {
                Ok(Attempt::Holding) => {
                    debug!(lease = %self.describe(), "renewed");
                    renewed_at = sent;
                }
                Ok(Attempt::HeldBy { holder, .. }) => {
                    return LeaderError::TakenOver {
                        lease: self.describe(),
                        holder,
                    }
                }
                Ok(Attempt::Failed(error)) => {
                    warn!(lease = %self.describe(), %error, "renewing the Lease failed; retrying");
                    last_error = error;
                }
                Err(_) => return self.not_renewed("the API server did not answer in time".into()),
            }
        }
    }

    fn not_renewed(&self, last_error: String) -> LeaderError {
        LeaderError::NotRenewed {
            lease: self.describe(),
            deadline: self.config.renew_deadline,
            last_error,
        }
    }

    /// Reads the Lease and, when this replica may hold it, writes itself as the holder.
    async fn try_acquire_or_renew(&mut self) -> Attempt {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let current = match self.leases.get_opt(&self.config.lease_name).await {
            Ok(Some(current)) => current,
            Ok(None) => return self.create(now).await,
            Err(error) => return Attempt::Failed(error.to_string()),
        };
        let seen = Instant::now();
        let observed = match self.observed.take() {
            // Unchanged: keep when it was first seen.
            Some(o) if o.lease.spec == current.spec => Observed {
                lease: current,
                since: o.since,
            },
            _ => Observed {
                lease: current,
                since: seen,
            },
        };
        let spec = observed.lease.spec.clone().unwrap_or_default();
        let expires = observed.since + record_duration(&spec, self.config.lease_duration);
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let mut next = observed.lease.clone();
        self.observed = Some(observed);
        if !holder.is_empty() && holder != self.config.identity && Instant::now() < expires {
            return Attempt::HeldBy { holder, expires };
        }
        next.spec = Some(next_spec(
            &spec,
            &self.config.identity,
            self.config.lease_seconds(),
            now,
        ));
        self.write(next).await
    }

    async fn create(&mut self, now: MicroTime) -> Attempt {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.config.lease_name.clone()),
                namespace: Some(self.config.lease_namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(next_spec(
                &LeaseSpec::default(),
                &self.config.identity,
                self.config.lease_seconds(),
                now,
            )),
        };
        match self.leases.create(&PostParams::default(), &lease).await {
            Ok(created) => {
                self.observe_own(created);
                Attempt::Holding
            }
            // 409: another replica created it first.
            Err(error) => Attempt::Failed(error.to_string()),
        }
    }

    /// An update guarded by the resourceVersion of the record read (a conflict: another replica wrote
    /// first).
    async fn write(&mut self, lease: Lease) -> Attempt {
        match self
            .leases
            .replace(&self.config.lease_name, &PostParams::default(), &lease)
            .await
        {
            Ok(written) => {
                self.observe_own(written);
                Attempt::Holding
            }
            Err(error) => Attempt::Failed(error.to_string()),
        }
    }

    fn observe_own(&mut self, lease: Lease) {
        self.observed = Some(Observed {
            lease,
            since: Instant::now(),
        });
    }

    /// Clears the holder if it is this replica (client-go's `ReleaseOnCancel`: holder empty, lease
    /// duration 1 s), retrying on conflicts, within one renew deadline. Whether the Lease is free of
    /// this replica.
    async fn release(&mut self) -> bool {
        let lease = self.describe();
        let released = tokio::time::timeout(self.config.renew_deadline, async {
            loop {
                let current = match self.leases.get_opt(&self.config.lease_name).await {
                    Ok(Some(current)) => current,
                    Ok(None) => return true,
                    Err(error) => {
                        warn!(lease = %lease, %error, "reading the Lease to release it failed");
                        return false;
                    }
                };
                let spec = current.spec.clone().unwrap_or_default();
                if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
                    return true;
                }
                let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
                let mut next = current;
                next.spec = Some(LeaseSpec {
                    holder_identity: None,
                    lease_duration_seconds: Some(1),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: spec.lease_transitions,
                    ..LeaseSpec::default()
                });
                match self
                    .leases
                    .replace(&self.config.lease_name, &PostParams::default(), &next)
                    .await
                {
                    Ok(_) => return true,
                    // A renewal that was in flight when the work ended landed meanwhile.
                    Err(kube::Error::Api(status)) if status.code == 409 => continue,
                    Err(error) => {
                        warn!(lease = %lease, %error, "releasing the Lease failed");
                        return false;
                    }
                }
            }
        })
        .await
        .unwrap_or(false);
        if released {
            info!(lease = %lease, "released the Lease");
        } else {
            warn!(lease = %lease, "could not release the Lease: another replica takes over once it expires");
        }
        released
    }
}

/// How long a record is valid after it was seen: its own `leaseDurationSeconds` (the holder's
/// setting), else this replica's.
fn record_duration(spec: &LeaseSpec, fallback: Duration) -> Duration {
    spec.lease_duration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .filter(|s| *s > 0)
        .map_or(fallback, Duration::from_secs)
}

/// The record `identity` writes over `current`: a renewal keeps the acquire time and the transitions,
/// a takeover counts one more transition.
fn next_spec(current: &LeaseSpec, identity: &str, lease_seconds: i32, now: MicroTime) -> LeaseSpec {
    let transitions = current.lease_transitions.unwrap_or(0);
    let renewing = current.holder_identity.as_deref() == Some(identity);
    let taken_over = current.holder_identity.is_some() || current.renew_time.is_some();
    LeaseSpec {
        holder_identity: Some(identity.to_string()),
        lease_duration_seconds: Some(lease_seconds),
        acquire_time: if renewing {
            current.acquire_time.clone()
        } else {
            Some(now.clone())
        },
        renew_time: Some(now),
        lease_transitions: Some(match (renewing, taken_over) {
            (true, _) | (false, false) => transitions,
            (false, true) => transitions.saturating_add(1),
        }),
        ..LeaseSpec::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> MicroTime {
        MicroTime(k8s_openapi::jiff::Timestamp::from_second(seconds).unwrap())
    }

    fn config(lease: u64, renew: u64, retry: u64) -> LeaderElectionConfig {
        LeaderElectionConfig {
            lease_duration: Duration::from_millis(lease),
            renew_deadline: Duration::from_millis(renew),
            retry_period: Duration::from_millis(retry),
            ..LeaderElectionConfig::new("gpu-dra", DEFAULT_LEASE_NAME, "a_1")
        }
    }

    #[test]
    fn the_timings_must_leave_the_leader_time_to_stop() {
        assert_eq!(config(15_000, 10_000, 2_000).check(), Ok(()));
        assert_eq!(config(1_000, 600, 200).check(), Ok(()));
        let err = config(10_000, 10_000, 2_000).check().unwrap_err();
        assert!(err.to_string().contains("--leader-elect-renew-deadline (10s) must be shorter than --leader-elect-lease-duration (10s)"), "{err}");
        let err = config(15_000, 10_000, 10_000).check().unwrap_err();
        assert!(err.to_string().contains("--leader-elect-retry-period (10s) must be shorter than --leader-elect-renew-deadline (10s)"), "{err}");
        assert_eq!(
            config(15_000, 10_000, 0).check(),
            Err(TimingError::Zero("retry-period"))
        );
    }

    #[test]
    fn the_lease_holds_whole_seconds_rounded_up() {
        assert_eq!(config(15_000, 10_000, 2_000).lease_seconds(), 15);
        assert_eq!(config(1_000, 600, 200).lease_seconds(), 1);
        assert_eq!(config(1_500, 600, 200).lease_seconds(), 2);
    }

    #[test]
    fn a_renewal_keeps_the_acquire_time_and_a_takeover_counts_a_transition() {
        let created = next_spec(&LeaseSpec::default(), "a_1", 15, at(100));
        assert_eq!(created.holder_identity.as_deref(), Some("a_1"));
        assert_eq!(created.lease_transitions, Some(0));
        assert_eq!(created.acquire_time, Some(at(100)));

        let renewed = next_spec(&created, "a_1", 15, at(102));
        assert_eq!(renewed.acquire_time, Some(at(100)));
        assert_eq!(renewed.renew_time, Some(at(102)));
        assert_eq!(renewed.lease_transitions, Some(0));

        let taken = next_spec(&renewed, "b_2", 15, at(120));
        assert_eq!(taken.holder_identity.as_deref(), Some("b_2"));
        assert_eq!(taken.acquire_time, Some(at(120)));
        assert_eq!(taken.lease_transitions, Some(1));

        // Released (holder cleared): taking it is a transition too, as in client-go.
        let released = LeaseSpec {
            holder_identity: None,
            lease_duration_seconds: Some(1),
            renew_time: Some(at(121)),
            acquire_time: Some(at(121)),
            lease_transitions: Some(1),
            ..LeaseSpec::default()
        };
        assert_eq!(
            next_spec(&released, "a_3", 15, at(122)).lease_transitions,
            Some(2)
        );
    }

    #[test]
    fn a_record_is_valid_for_its_own_duration() {
        let spec = LeaseSpec {
            lease_duration_seconds: Some(30),
            ..LeaseSpec::default()
        };
        assert_eq!(
            record_duration(&spec, Duration::from_secs(15)),
            Duration::from_secs(30)
        );
        assert_eq!(
            record_duration(&LeaseSpec::default(), Duration::from_secs(15)),
            Duration::from_secs(15)
        );
    }
}

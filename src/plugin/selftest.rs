//! The DeviceClass self-test: at start and whenever DeviceClasses or this node's devices change, every
//! class is evaluated against the devices the plugin publishes. A class whose selectors error here, or
//! that is meant for this driver and matches none of its devices, is reported as an Event on the Node, a
//! log line and the `device_class_problems` metric: otherwise it shows only as Pending pods.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::resource::v1::{Device, DeviceClass};
use kube::api::Api;
use kube::runtime::events::EventType;
use kube::runtime::{reflector, watcher};
use kube::ResourceExt;
use tokio::sync::watch;
use tracing::{info, warn};

use super::node_events::NodeEvents;
use crate::cel::{DeviceView, Selector};
use crate::devices::NodeDevices;
use crate::observability::Metrics;

/// Changes closer together than this are checked once: a `kubectl apply` of many classes is one check.
const SETTLE: Duration = Duration::from_millis(200);

/// What is wrong with a class on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClassProblem {
    /// A selector failed to compile or errored on a device. In the scheduler this aborts allocation of
    /// every claim that uses the class, whatever the other devices say.
    SelectorError {
        selector: usize,
        device: Option<String>,
        message: String,
    },
    /// The class names this driver but none of this node's devices passes its selectors.
    MatchesNothing {
        devices: usize,
        /// The selector that refused the first device, for a hint of what is wrong.
        first_refusal: Option<(String, usize)>,
    },
}

impl ClassProblem {
    /// The Event reason and the metric's `problem` label.
    pub fn reason(&self) -> &'static str {
        match self {
            ClassProblem::SelectorError { .. } => "DeviceClassSelectorError",
            ClassProblem::MatchesNothing { .. } => "DeviceClassMatchesNothing",
        }
    }

    fn describe(&self, class: &str, driver: &str) -> String {
        match self {
            ClassProblem::SelectorError {
                selector,
                device: Some(device),
                message,
            } => format!(
                "DeviceClass {class}: selector #{selector} on device {device}: {message}; the scheduler \
                 aborts allocation of every claim that uses this class"
            ),
            ClassProblem::SelectorError {
                selector,
                device: None,
                message,
            } => format!(
                "DeviceClass {class}: selector #{selector}: {message}; the scheduler aborts allocation \
                 of every claim that uses this class"
            ),
            ClassProblem::MatchesNothing {
                devices,
                first_refusal,
            } => {
                let hint = first_refusal
                    .as_ref()
                    .map(|(device, selector)| {
                        format!(" (selector #{selector} refuses device {device})")
                    })
                    .unwrap_or_default();
                format!(
                    "DeviceClass {class} names driver {driver} but matches none of its {devices} \
                     devices on this node{hint}"
                )
            }
        }
    }
}

/// A class with a problem on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassFinding {
    pub class: String,
    pub problem: ClassProblem,
    /// What the Event and log say.
    pub message: String,
}

/// Evaluates every class against `devices` (this driver's devices on this node), as the scheduler would:
/// selectors in order, the first false decides. Errors are reported for every class, because the
/// scheduler evaluates a class on all devices of a node and an error anywhere blocks its claims. "Matches
/// nothing" is reported only for classes meant for this driver: those whose selectors name the driver
/// in a string literal (`device.driver == "gpu.dra.dev"`, `device.attributes["gpu.dra.dev"]`), since
/// other drivers' classes are expected to match nothing here.
pub fn check_classes(
    driver: &str,
    classes: &[DeviceClass],
    devices: &[Device],
) -> Vec<ClassFinding> {
    let views: Vec<(&str, DeviceView)> = devices
        .iter()
        .map(|d| (d.name.as_str(), DeviceView::new(driver, d)))
        .collect();
    let mut findings = Vec::new();
    for class in classes {
        let name = class.name_any();
        let expressions: Vec<&str> = class
            .spec
            .iter()
            .flat_map(|spec| spec.selectors.iter().flatten())
            .filter_map(|s| s.cel.as_ref().map(|c| c.expression.as_str()))
            .collect();
        if let Some(problem) = check_class(driver, &expressions, &views) {
            findings.push(ClassFinding {
                message: problem.describe(&name, driver),
                class: name,
                problem,
            });
        }
    }
    findings
}

fn check_class(
    driver: &str,
    expressions: &[&str],
    devices: &[(&str, DeviceView)],
) -> Option<ClassProblem> {
    let mut selectors = Vec::new();
    for (index, expression) in expressions.iter().enumerate() {
        match Selector::compile(expression) {
            Ok(selector) => selectors.push(selector),
            Err(error) => {
                return Some(ClassProblem::SelectorError {
                    selector: index,
                    device: None,
                    message: error.to_string(),
                })
            }
        }
    }
    let mut matched = false;
    let mut first_refusal = None;
    'devices: for (device, view) in devices {
        for (index, selector) in selectors.iter().enumerate() {
            match selector.matches(view) {
                Ok(true) => {}
                Ok(false) => {
                    first_refusal.get_or_insert_with(|| (device.to_string(), index));
                    continue 'devices;
                }
                Err(error) => {
                    return Some(ClassProblem::SelectorError {
                        selector: index,
                        device: Some(device.to_string()),
                        message: error.to_string(),
                    })
                }
            }
        }
        matched = true;
    }
    let names_driver = expressions
        .iter()
        .any(|e| e.contains(&format!("\"{driver}\"")) || e.contains(&format!("'{driver}'")));
    // A node outside any NVLink clique publishes no IMEX channel: the channel class is meant to match
    // nothing there.
    let channels_class = crate::domains::channels::is_channel_class(expressions.iter().copied());
    let node_has_channels = devices
        .iter()
        .any(|(name, _)| crate::domains::channels::parse_device_name(name).is_some());
    if channels_class && !node_has_channels {
        return None;
    }
    // Likewise passthrough devices: only GPUs a GpuNodePolicy chose are published so.
    let passthrough_class =
        crate::devices::passthrough::is_passthrough_class(expressions.iter().copied());
    let node_has_passthrough = devices
        .iter()
        .any(|(name, _)| crate::devices::passthrough::parse_device_name(name).is_some());
    if passthrough_class && !node_has_passthrough {
        return None;
    }
    (!matched && names_driver && !devices.is_empty()).then_some(ClassProblem::MatchesNothing {
        devices: devices.len(),
        first_refusal,
    })
}

/// Runs the self-test until shutdown: watches DeviceClasses (with `watch_config`, whose timeout decides
/// how soon a half-open watch is noticed), follows this node's devices, and reports
/// each problem when it appears or changes (not again while it stays the same).
pub async fn run(
    client: kube::Client,
    driver: String,
    events: Arc<NodeEvents>,
    mut devices: watch::Receiver<Arc<NodeDevices>>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
    watch_config: watcher::Config,
) {
    let (store, writer) = reflector::store::<DeviceClass>();
    let mut classes = std::pin::pin!(crate::apiclient::retried(reflector(
        writer,
        watcher(Api::<DeviceClass>::all(client), watch_config)
    )));
    let mut listed = false;
    let mut reported: BTreeMap<String, ClassFinding> = BTreeMap::new();
    loop {
        tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => break,
            event = classes.next() => match event {
                None => break,
                Some(Err(error)) => {
                    warn!(%error, "watching DeviceClasses failed; retrying");
                    continue;
                }
                Some(Ok(watcher::Event::InitDone)) => listed = true,
                Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => continue,
                Some(Ok(_)) => {}
            },
            changed = devices.changed() => if changed.is_err() { break },
        }
        if !listed {
            continue;
        }
        // Let a burst of changes settle, then check the state as it is now.
        tokio::time::sleep(SETTLE).await;
        let current: Vec<Device> = devices.borrow_and_update().devices().cloned().collect();
        let classes_now: Vec<DeviceClass> = store.state().iter().map(|c| (**c).clone()).collect();
        let findings = check_classes(&driver, &classes_now, &current);
        metrics.set_device_class_problems(
            &findings
                .iter()
                .map(|f| (f.class.clone(), f.problem.reason()))
                .collect::<Vec<_>>(),
        );
        let mut now: BTreeMap<String, ClassFinding> = BTreeMap::new();
        for finding in findings {
            if reported.get(&finding.class) != Some(&finding) {
                match finding.problem {
                    ClassProblem::SelectorError { .. } => {
                        warn!(class = %finding.class, reason = finding.problem.reason(), "{}", finding.message)
                    }
                    ClassProblem::MatchesNothing { .. } => {
                        info!(class = %finding.class, reason = finding.problem.reason(), "{}", finding.message)
                    }
                }
                publish(&events, &finding).await;
            }
            now.insert(finding.class.clone(), finding);
        }
        for class in reported.keys().filter(|c| !now.contains_key(*c)) {
            info!(class = %class, "DeviceClass no longer has a problem on this node");
        }
        reported = now;
    }
}

async fn publish(events: &NodeEvents, finding: &ClassFinding) {
    // An error blocks every claim of the class; matching nothing on one node is fine when other nodes
    // serve the class (a MIG class on a node without MIG), so that one is Normal.
    let type_ = match finding.problem {
        ClassProblem::SelectorError { .. } => EventType::Warning,
        ClassProblem::MatchesNothing { .. } => EventType::Normal,
    };
    let class = ObjectReference {
        api_version: Some("resource.k8s.io/v1".to_string()),
        kind: Some("DeviceClass".to_string()),
        name: Some(finding.class.clone()),
        ..Default::default()
    };
    events
        .publish(
            type_,
            finding.problem.reason(),
            "CheckDeviceClass",
            &finding.message,
            Some(class),
        )
        .await;
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{
        CELDeviceSelector, Device, DeviceAttribute, DeviceClass, DeviceClassSpec, DeviceSelector,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::{check_classes, ClassProblem};

    const DRIVER: &str = "gpu.dra.dev";

    fn class(name: &str, expressions: &[&str]) -> DeviceClass {
        DeviceClass {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                ..Default::default()
            },
            spec: Some(DeviceClassSpec {
                selectors: Some(
                    expressions
                        .iter()
                        .map(|e| DeviceSelector {
                            cel: Some(CELDeviceSelector {
                                expression: e.to_string(),
                            }),
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
        }
    }

    fn gpu(name: &str, kind: &str) -> Device {
        Device {
            name: name.to_string(),
            attributes: Some(
                [(
                    "type".to_string(),
                    DeviceAttribute {
                        string: Some(kind.to_string()),
                        ..Default::default()
                    },
                )]
                .into(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn a_class_that_matches_a_device_is_fine() {
        let classes = [class(
            "gpus",
            &[
                r#"device.driver == "gpu.dra.dev""#,
                r#"device.attributes["gpu.dra.dev"].type == "gpu""#,
            ],
        )];
        let devices = [gpu("gpu-0", "mig"), gpu("gpu-1", "gpu")];
        assert_eq!(check_classes(DRIVER, &classes, &devices), vec![]);
    }

    #[test]
    fn matching_nothing_names_the_first_refusal_and_counts_only_for_this_drivers_classes() {
        let classes = [
            class(
                "migs",
                &[
                    r#"device.driver == 'gpu.dra.dev'"#,
                    r#"device.attributes["gpu.dra.dev"].type == "mig""#,
                ],
            ),
            class("other", &[r#"device.driver == "other.example.com""#]),
        ];
        let devices = [gpu("gpu-0", "gpu"), gpu("gpu-1", "gpu")];
        let findings = check_classes(DRIVER, &classes, &devices);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].class, "migs");
        assert_eq!(
            findings[0].problem,
            ClassProblem::MatchesNothing {
                devices: 2,
                first_refusal: Some(("gpu-0".to_string(), 1)),
            }
        );
        assert!(findings[0]
            .message
            .contains("(selector #1 refuses device gpu-0)"));
        // A node without devices has nothing to match: no finding, however the class reads.
        assert_eq!(check_classes(DRIVER, &classes[..1], &[]), vec![]);
    }

    #[test]
    fn the_channel_class_matching_nothing_is_a_problem_only_where_channels_are_published() {
        let channels = [class(
            "imex-channel.gpu.dra.dev",
            &[
                r#"device.driver == "gpu.dra.dev" && device.attributes["gpu.dra.dev"].type == "imex-channel""#,
            ],
        )];
        // An H100 node: no NVLink clique, no channels; the class is meant to match nothing.
        assert_eq!(
            check_classes(DRIVER, &channels, &[gpu("gpu-0", "gpu")]),
            vec![]
        );
        // A fabric node whose channels the class misses (here: their type misspelled) is reported.
        let misspelled = [gpu("gpu-0", "gpu"), gpu("imex-channel-0", "imex")];
        let findings = check_classes(DRIVER, &channels, &misspelled);
        assert_eq!(findings.len(), 1, "{findings:?}");
    }

    #[test]
    fn errors_are_reported_for_every_class_with_selector_and_device() {
        let classes = [
            class(
                "unknown-attribute",
                &[r#"device.attributes["other.example.com"].model == "x""#],
            ),
            class("syntax", &[r#"device.driver =="#]),
        ];
        let findings = check_classes(DRIVER, &classes, &[gpu("gpu-0", "gpu")]);
        assert_eq!(findings.len(), 2, "{findings:?}");
        match &findings[0].problem {
            ClassProblem::SelectorError {
                selector: 0,
                device: Some(device),
                message,
            } => {
                assert_eq!(device, "gpu-0");
                assert!(message.starts_with("runtime error:"), "{message}");
                assert!(message.contains("no such key: model"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        match &findings[1].problem {
            ClassProblem::SelectorError {
                selector: 0,
                device: None,
                message,
            } => assert!(message.starts_with("compile error:"), "{message}"),
            other => panic!("{other:?}"),
        }
        assert!(findings[1].message.contains("aborts allocation"));
    }
}

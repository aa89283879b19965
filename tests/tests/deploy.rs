//! The deployment files agree with the agent and with each other: the
//! default configuration and the Kubernetes one pass `agent service
//! --check-config`; the unit's and the DaemonSet's command lines use options
//! `agent service --help` lists; the DaemonSet grants exactly the unit's
//! capabilities with the same limits, mounts what the configuration points
//! at, and probes and scrapes the port the configuration listens on; the
//! Dockerfile builds what the DaemonSet runs. (Whether the unit works under
//! systemd: `tests/tests/systemd.rs`.) The YAML is read with Debian's
//! python3-yaml, installed if missing.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;
use xpuscope_tests::agent::{TempDir, agent_bin};
use xpuscope_tests::fixtures;

fn read(path: &str) -> String {
    let p = fixtures::repo_root().join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Debian's Python, where `apt-get install python3-yaml` puts the module
/// (another `python3` may come first on PATH).
fn python() -> &'static str {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

/// Every document of a YAML file, as JSON.
fn yaml_documents(path: &str) -> Vec<Value> {
    let have_yaml = || {
        Command::new(python())
            .args(["-c", "import yaml"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !have_yaml() {
        xpuscope_tests::packages::apt_install(&["python3-yaml"]);
        assert!(
            have_yaml(),
            "python3-yaml is not importable after installing it"
        );
    }
    let out = Command::new(python())
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(fixtures::repo_root().join(path))
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{path} is not valid YAML: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Vec<Value>>(&out.stdout)
        .expect("JSON from python")
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in the manifests"))
}

/// The value of `key=` in a unit file (the last one wins, as in systemd).
fn unit_value<'a>(unit: &'a str, key: &str) -> &'a str {
    unit.lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .next_back()
        .unwrap_or_else(|| panic!("the unit sets no {key}="))
}

/// The string value of `key = "..."` in a TOML text (flat lookup: the keys
/// checked here are unique in the files).
fn toml_string(text: &str, key: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == key).then(|| {
                v.split('#')
                    .next()
                    .unwrap()
                    .trim()
                    .trim_matches('"')
                    .to_string()
            })
        })
        .unwrap_or_else(|| panic!("no {key} in:\n{text}"))
}

fn check_config(text: &str) {
    let dir = TempDir::new("deploy");
    let file = dir.path().join("agent.toml");
    std::fs::write(&file, text).unwrap();
    let out = Command::new(agent_bin())
        .args(["service", "--check-config", "--config"])
        .arg(&file)
        .output()
        .expect("run agent");
    assert!(
        out.status.success(),
        "agent service --check-config refuses:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `agent service ARGS` uses only options `agent service --help` lists.
fn check_service_args(args: &[&str]) {
    assert_eq!(args.first(), Some(&"service"), "{args:?}");
    let out = Command::new(agent_bin())
        .args(["service", "--help"])
        .output()
        .expect("run agent");
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in args.iter().filter(|a| a.starts_with("--")) {
        assert!(
            help.lines()
                .any(|l| l.trim_start().split([' ', ',']).any(|w| w == *flag)),
            "{flag} is not an option of `agent service`:\n{help}"
        );
    }
}

/// Bytes of a systemd size (`1G`) or a Kubernetes quantity (`1Gi`).
fn bytes(size: &str) -> u64 {
    let (digits, unit) = size.split_at(
        size.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(size.len()),
    );
    let n: u64 = digits.parse().unwrap_or_else(|_| panic!("a size: {size}"));
    n << match unit {
        "" => 0,
        "K" | "Ki" => 10,
        "M" | "Mi" => 20,
        "G" | "Gi" => 30,
        other => panic!("unit {other} in {size}"),
    }
}

#[test]
fn the_unit_and_the_default_config_fit_the_agent() {
    let unit = read("deploy/systemd/xpuscope-agent.service");
    let config = read("deploy/agent.toml");
    check_config(&config);
    let exec: Vec<&str> = unit_value(&unit, "ExecStart").split_whitespace().collect();
    assert_eq!(
        exec[0], "/usr/local/bin/agent",
        "xtask install's default prefix"
    );
    check_service_args(&exec[1..]);
    let at = exec
        .iter()
        .position(|a| *a == "--config")
        .expect("--config");
    assert_eq!(
        exec[at + 1],
        "/etc/xpuscope/agent.toml",
        "where xtask installs it"
    );
    assert_eq!(unit_value(&unit, "Type"), "notify");
    assert_eq!(unit_value(&unit, "StateDirectory"), "xpuscope");
    assert!(
        toml_string(&config, "dump_dir").starts_with("/var/lib/xpuscope/"),
        "dumps go where the unit may write"
    );
    assert_eq!(
        Path::new(&toml_string(&config, "socket")).parent(),
        Some(
            Path::new("/run")
                .join(unit_value(&unit, "RuntimeDirectory"))
                .as_path()
        ),
        "the control socket is in the unit's RuntimeDirectory"
    );
}

#[test]
fn the_daemonset_matches_the_unit() {
    let unit = read("deploy/systemd/xpuscope-agent.service");
    let docs = yaml_documents("deploy/kubernetes/daemonset.yaml");
    let ds = kind(&docs, "DaemonSet");
    let pod = &ds["spec"]["template"];
    let spec = &pod["spec"];
    assert_eq!(spec["hostPID"], true, "pids as the eBPF programs see them");
    assert!(
        spec["hostNetwork"].is_null() || spec["hostNetwork"] == false,
        "the pod's own network namespace (see the manifest's header)"
    );
    let containers = spec["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let c = &containers[0];

    // Kept running and scheduled where it is useful, with nothing it does
    // not need.
    assert_eq!(spec["priorityClassName"], "system-node-critical");
    assert_eq!(spec["automountServiceAccountToken"], false);
    let terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()
        .expect("node selector terms: accelerator nodes only");
    let keys: BTreeSet<&str> = terms
        .iter()
        .flat_map(|t| t["matchExpressions"].as_array().into_iter().flatten())
        .filter_map(|e| e["key"].as_str())
        .collect();
    assert_eq!(
        keys,
        BTreeSet::from(["nvidia.com/gpu.present", "accelerator"]),
        "{terms:?}"
    );
    let version = toml_string(&read("Cargo.toml"), "version");
    assert_eq!(
        c["image"]
            .as_str()
            .and_then(|i| i.rsplit_once(':'))
            .map(|(_, tag)| tag),
        Some(version.as_str()),
        "the image's tag is the release's version"
    );
    // The metrics' `node` is the node's name (the downward API's
    // spec.nodeName), not the pod's host name.
    let node_name = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "NODE_NAME")
        .expect("NODE_NAME in the environment");
    assert_eq!(
        node_name["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName",
        "{node_name}"
    );
    // Every `kubectl ... -l KEY=VALUE` the guide tells a user to run selects
    // the agent's pods.
    let labels = &pod["metadata"]["labels"];
    let guide = read("docs/src/guide/service.md");
    let selectors: Vec<&str> = guide
        .lines()
        .filter(|l| l.contains("kubectl") && l.contains(" -l "))
        .filter_map(|l| l.split(" -l ").nth(1)?.split_whitespace().next())
        .collect();
    assert!(!selectors.is_empty(), "the guide's kubectl selectors");
    for sel in selectors {
        let (key, value) = sel.split_once('=').expect("KEY=VALUE");
        assert_eq!(
            labels[key], value,
            "selector {sel} against the pod's labels {labels}"
        );
    }

    // Same capabilities as the unit, nothing else.
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    let added: BTreeSet<String> = sc["capabilities"]["add"]
        .as_array()
        .expect("added capabilities")
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect();
    let bounded: BTreeSet<String> = unit_value(&unit, "CapabilityBoundingSet")
        .split_whitespace()
        .map(|c| c.strip_prefix("CAP_").unwrap().to_string())
        .collect();
    assert_eq!(added, bounded, "the DaemonSet's capabilities vs the unit's");

    // Same limits.
    let limits = &c["resources"]["limits"];
    assert_eq!(
        bytes(limits["memory"].as_str().unwrap()),
        bytes(unit_value(&unit, "MemoryMax")),
        "memory limit vs MemoryMax"
    );
    let quota: u64 = unit_value(&unit, "CPUQuota")
        .trim_end_matches('%')
        .parse()
        .unwrap();
    assert_eq!(
        limits["cpu"],
        (quota / 100).to_string(),
        "cpu limit vs CPUQuota"
    );
    let stop: u64 = unit_value(&unit, "TimeoutStopSec")
        .trim_end_matches('s')
        .parse()
        .unwrap();
    assert!(spec["terminationGracePeriodSeconds"].as_u64().unwrap() >= stop);
    assert!(
        spec["tolerations"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["operator"] == "Exists")),
        "runs on tainted (GPU) nodes too"
    );

    // The command line, and the configuration it names.
    let command: Vec<&str> = c["command"]
        .as_array()
        .unwrap()
        .iter()
        .chain(c["args"].as_array().unwrap())
        .map(|a| a.as_str().unwrap())
        .collect();
    // The image installs the package, whose unit runs /usr/bin/agent (the
    // shipped unit's /usr/local/bin/agent is `cargo xtask install`'s).
    assert_eq!(command[0], "/usr/bin/agent");
    assert_eq!(
        unit_value(&unit, "ExecStart").split_once(' ').map(|c| c.1),
        Some(command[1..].join(" ").as_str()),
        "the unit's arguments"
    );
    check_service_args(&command[1..]);
    let config_path = command[command.iter().position(|a| *a == "--config").unwrap() + 1];
    let mounts = c["volumeMounts"].as_array().expect("volumeMounts");
    let volumes = spec["volumes"].as_array().expect("volumes");
    // The volume mounted over `path` (the deepest mount holding it).
    let volume_at = |path: &str| {
        let m = mounts
            .iter()
            .filter(|m| Path::new(path).starts_with(m["mountPath"].as_str().unwrap()))
            .max_by_key(|m| m["mountPath"].as_str().unwrap().len())
            .unwrap_or_else(|| panic!("nothing mounted at {path}"));
        let v = volumes
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap_or_else(|| panic!("no volume {}", m["name"]));
        (m.clone(), v.clone())
    };
    let (mount, volume) = volume_at(config_path);
    let key = Path::new(config_path)
        .strip_prefix(mount["mountPath"].as_str().unwrap())
        .unwrap()
        .to_str()
        .unwrap();
    let cm_name = volume["configMap"]["name"].as_str().expect("a ConfigMap");
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == cm_name)
        .expect("the ConfigMap");
    let config = cm["data"][key].as_str().expect("the configuration");
    check_config(config);

    // What the configuration points at is mounted from the node.
    for path in [
        toml_string(config, "dump_dir"),
        toml_string(config, "socket"),
    ] {
        let (m, v) = volume_at(&path);
        assert!(v["hostPath"].is_object(), "{path}: on the node ({v})");
        assert_ne!(m["readOnly"], true, "{path}: writable");
    }
    for path in ["/sys/kernel/btf", "/sys/kernel/tracing"] {
        let (m, v) = volume_at(path);
        assert_eq!(m["mountPath"], path);
        assert_eq!(v["hostPath"]["path"], path);
    }
    assert!(
        volume_at("/tmp").1["emptyDir"].is_object(),
        "a writable /tmp on a read-only root"
    );

    // Metrics: listened on, probed, scraped, all on one port.
    let listen = toml_string(config, "listen");
    let (host, port) = listen.rsplit_once(':').unwrap();
    assert_eq!(host, "0.0.0.0", "reachable at the pod IP");
    let port: u64 = port.parse().unwrap();
    let ports = c["ports"].as_array().unwrap();
    let named = ports
        .iter()
        .find(|p| p["containerPort"] == port)
        .expect("the metrics port is declared");
    for probe in ["readinessProbe", "livenessProbe"] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], "/healthz", "{probe}");
        assert!(
            get["port"] == port || get["port"] == named["name"],
            "{probe} on the metrics port"
        );
    }
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/port"], port.to_string());
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    let monitor = yaml_documents("deploy/kubernetes/podmonitor.yaml");
    let monitor = kind(&monitor, "PodMonitor");
    assert_eq!(
        monitor["spec"]["selector"]["matchLabels"],
        pod["metadata"]["labels"]
    );
    assert_eq!(
        monitor["spec"]["podMetricsEndpoints"][0]["port"],
        named["name"]
    );

    // The image: the Debian package installed, run as the DaemonSet says
    // (built from source, or from a package built elsewhere).
    let dockerfile = read("Dockerfile");
    assert!(dockerfile.contains("RUN cargo xtask package"));
    for file in ["Dockerfile", "deploy/docker/Dockerfile.package"] {
        let text = read(file);
        assert!(
            text.contains("apt-get install -y --no-install-recommends /tmp/xpuscope_*_amd64.deb"),
            "{file}"
        );
        assert!(
            text.contains(&format!("ENTRYPOINT [\"{}\"]", command[0])),
            "{file}"
        );
    }
}

/// `kubernetes-validate` (PyPI: the Kubernetes API's own schemas, offline)
/// in a virtual environment of its own, made once and kept in
/// /var/cache/xpuscope-test.
fn kubernetes_validate() -> std::path::PathBuf {
    let venv = Path::new("/var/cache/xpuscope-test/k8s-venv");
    let bin = venv.join("bin/kubernetes-validate");
    if bin.exists() {
        return bin;
    }
    // Made aside and renamed: a concurrent or interrupted run never
    // leaves a half-installed environment in place.
    let tmp = venv.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let venv_made = || {
        Command::new(python())
            .args(["-m", "venv"])
            .arg(&tmp)
            .status()
            .is_ok_and(|s| s.success())
    };
    // Debian keeps venv's pip bootstrap in python3-venv.
    if !venv_made() {
        xpuscope_tests::packages::apt_install(&["python3-venv"]);
    }
    let made = venv_made()
        && Command::new(tmp.join("bin/pip"))
            .args(["install", "-q", "kubernetes-validate"])
            .status()
            .is_ok_and(|s| s.success());
    assert!(
        made,
        "installing kubernetes-validate from PyPI into {} failed (python3-venv and network to PyPI are needed)",
        tmp.display()
    );
    let _ = std::fs::rename(&tmp, venv);
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(bin.exists(), "{} after installing", bin.display());
    bin
}

/// The DaemonSet, its namespace and ConfigMap are valid objects for the
/// Kubernetes versions fleets run (strict: no field the API does not know,
/// so a misspelt key fails here rather than being dropped by the API
/// server).
#[test]
fn the_kubernetes_manifests_validate_against_the_api_schemas() {
    let validate = kubernetes_validate();
    let manifest = fixtures::repo_root().join("deploy/kubernetes/daemonset.yaml");
    for version in ["1.27", "1.30", "1.33"] {
        // Run by the environment's own interpreter: the script's shebang
        // names the path the environment was made at before its rename.
        let python = validate.with_file_name("python3");
        let out = Command::new(&python)
            .arg(&validate)
            .args(["--strict", "-k", version])
            .arg(&manifest)
            .output()
            .expect("run kubernetes-validate");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "Kubernetes {version}:\n{text}");
        for kind in ["namespace", "configmap", "daemonset"] {
            assert!(
                text.contains(&format!("passed for resource {kind}/")),
                "Kubernetes {version}: {kind} not validated:\n{text}"
            );
        }
    }
}

/// Debian's promtool (with its Prometheus), installed when missing.
fn promtool() -> &'static str {
    xpuscope_tests::packages::ensure_tool("promtool", "prometheus")
}

/// The cluster-wide rules: valid, each alert firing on what it means and
/// quiet on a healthy job (`promtool test rules` on the unit tests beside
/// them), and the PrometheusRule holding the very same groups.
#[test]
fn the_prometheus_rules_check_and_pass_their_unit_tests() {
    let dir = fixtures::repo_root().join("deploy/prometheus");
    for (args, what) in [
        (
            vec!["check", "rules", "xpuscope-rules.yml"],
            "promtool check rules",
        ),
        (
            vec!["test", "rules", "tests/xpuscope-rules.test.yml"],
            "promtool test rules",
        ),
    ] {
        let out = Command::new(promtool())
            .args(&args)
            .current_dir(&dir)
            .output()
            .expect("run promtool");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{what}:\n{text}");
        assert!(text.contains("SUCCESS"), "{what}:\n{text}");
    }
    let rules = yaml_documents("deploy/prometheus/xpuscope-rules.yml");
    let operator = yaml_documents("deploy/prometheus/xpuscope-rules.prometheusrule.yaml");
    let resource = kind(&operator, "PrometheusRule");
    assert_eq!(resource["spec"]["groups"], rules[0]["groups"]);
    let alerts: BTreeSet<&str> = rules[0]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["alert"].as_str())
        .collect();
    assert_eq!(
        alerts,
        BTreeSet::from([
            "XpuscopeRankHoldsBackJob",
            "XpuscopeSlowRank",
            "XpuscopeDeviceMemoryGrowing",
            "XpuscopeAgentLosingEvents",
        ])
    );
}

/// The Debian package (`cargo xtask package`, here of the agent the tests
/// built): its files, a conffile for the configuration, glibc and procps
/// (the unit's `kill`) its only dependencies; installed with dpkg on Debian 12 (a root without this
/// machine's toolchain, run as a container so the cached root stays
/// clean), its agent runs, reads the packaged configuration, and
/// systemd accepts its unit.
#[test]
fn the_package_installs_on_debian_12_and_its_agent_runs() {
    use xpuscope_tests::roots::{self, Entry};
    let version = toml_string(&read("Cargo.toml"), "version");
    let deb = xpuscope_tests::packages::xpuscope_deb();
    assert_eq!(
        deb.file_name().unwrap().to_string_lossy(),
        format!("xpuscope_{version}_amd64.deb")
    );
    let dpkg_deb = |args: &[&str]| {
        let out = Command::new("dpkg-deb")
            .args(args)
            .arg(deb)
            .output()
            .expect("run dpkg-deb");
        assert!(out.status.success(), "dpkg-deb {args:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let listing = dpkg_deb(&["-c"]);
    for file in [
        "./usr/bin/agent",
        "./lib/systemd/system/xpuscope-agent.service",
        "./etc/xpuscope/agent.toml",
        "./usr/share/man/man1/agent.1.gz",
        "./usr/share/bash-completion/completions/agent",
        "./usr/share/zsh/vendor-completions/_agent",
        "./usr/share/fish/vendor_completions.d/agent.fish",
        "./usr/share/doc/xpuscope/copyright",
    ] {
        assert!(
            listing.lines().any(|l| l.ends_with(file)),
            "{file} not in the package:\n{listing}"
        );
    }
    // Files owned by root, whoever built the package.
    assert!(
        listing.lines().all(|l| l.contains(" root/root ")),
        "{listing}"
    );
    assert_eq!(
        dpkg_deb(&["-f"])
            .lines()
            .find(|l| l.starts_with("Depends:")),
        Some("Depends: libc6 (>= 2.34), procps")
    );

    let root = roots::bookworm();
    let dir = roots::place(root, "package", &[deb]);
    let script = format!(
        "set -e\n\
         ! command -v cargo\n\
         ! command -v gdb\n\
         dpkg -i {dir}/xpuscope_{version}_amd64.deb\n\
         agent --version\n\
         agent service --check-config --config /etc/xpuscope/agent.toml\n\
         systemd-analyze verify /lib/systemd/system/xpuscope-agent.service\n\
         dpkg-query -W -f='${{Conffiles}}\\n' xpuscope\n\
         test -s /usr/share/man/man1/agent.1.gz\n"
    );
    let out = Entry::Container
        .command(root, "/bin/sh")
        .args(["-c", &script])
        .output()
        .expect("run the install in the Debian 12 root");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "installing on Debian 12:\n{text}");
    assert!(text.contains(&format!("agent {version} (")), "{text}");
    assert!(
        text.contains("/etc/xpuscope/agent.toml "),
        "the configuration is a conffile:\n{text}"
    );
}

/// The runtime image from the package, offline: Debian's podman builds
/// `deploy/docker/Dockerfile.package` on a local base (the cached Debian
/// 12 root, imported; nothing pulled, nothing downloaded: the base has the
/// package's dependencies), and the image holds the agent at the
/// DaemonSet's path, runnable there, with its configuration.
#[test]
fn the_image_builds_offline_from_the_package() {
    let podman = xpuscope_tests::packages::ensure_tool("podman", "podman");
    let deb = xpuscope_tests::packages::xpuscope_deb();
    let root = xpuscope_tests::roots::bookworm();
    let base = "localhost/xpuscope-test-base:bookworm";
    let image = format!("localhost/xpuscope-agent-test:{}", std::process::id());
    let run = |args: &[&str]| {
        let out = Command::new(podman)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("podman {args:?}: {e}"));
        assert!(
            out.status.success(),
            "podman {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    // The base, once per root (podman keeps it between runs).
    let stamp = std::fs::read_to_string(root.join(".xpuscope-root")).unwrap_or_default();
    let have = Command::new(podman)
        .args([
            "image",
            "inspect",
            "--format",
            "{{index .Labels \"xpuscope.root\"}}",
            base,
        ])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == stamp.trim());
    if !have {
        let import = format!(
            "tar -C '{}' --exclude=./proc/* --exclude=./xpuscope -c . | {podman} import \
             --change 'LABEL xpuscope.root=\"{}\"' - {base}",
            root.display(),
            stamp.trim()
        );
        let out = Command::new("sh").args(["-c", &import]).output().unwrap();
        assert!(out.status.success(), "importing the base: {out:?}");
    }
    let context = TempDir::new("image");
    std::fs::copy(deb, context.path().join(deb.file_name().unwrap())).unwrap();
    let dockerfile = fixtures::repo_root().join("deploy/docker/Dockerfile.package");
    // chroot isolation: no cgroups or network set-up needed for the RUN
    // step (this machine's cgroups are hybrid, which crun refuses).
    run(&[
        "build",
        "--isolation=chroot",
        "--pull=never",
        "--build-arg",
        &format!("BASE={base}"),
        "-f",
        dockerfile.to_str().unwrap(),
        "-t",
        &image,
        context.path().to_str().unwrap(),
    ]);
    let mounted = PathBuf::from(run(&["image", "mount", &image]));
    let version = Command::new("chroot")
        .arg(&mounted)
        .args(["/usr/bin/agent", "--version"])
        .output()
        .expect("run the image's agent");
    let config = mounted.join("etc/xpuscope/agent.toml").exists();
    let entrypoint = run(&[
        "image",
        "inspect",
        "--format",
        "{{json .Config.Entrypoint}}",
        &image,
    ]);
    run(&["image", "umount", &image]);
    run(&["rmi", &image]);
    assert!(version.status.success(), "{version:?}");
    assert!(
        String::from_utf8_lossy(&version.stdout).starts_with("agent "),
        "{version:?}"
    );
    assert!(config, "/etc/xpuscope/agent.toml in the image");
    assert_eq!(entrypoint, "[\"/usr/bin/agent\"]");
}

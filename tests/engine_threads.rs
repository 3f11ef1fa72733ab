//! `tierzero.pin_threads`: where an offloaded trainer's threads run. Alone
//! in its binary, so the only threads of the process are this test's.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod engine_support;

use engine_support::{build, tiny_gpt2_dir, Knobs};
use tierzero::engine::host::threads::Placement;
use tierzero_swap::affinity::{current_thread_cpus, pin_current_thread};

/// The CPUs `/proc` says a thread of this process may use.
fn cpus_of(tid: &str) -> Vec<usize> {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_owned();
    list.split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().unwrap()..=b.parse().unwrap()).collect(),
            None => vec![part.parse::<usize>().unwrap()],
        })
        .collect()
}

/// (name, CPUs) of every thread whose name starts with one of `prefixes`.
fn helpers(prefixes: &[&str]) -> Vec<(String, Vec<usize>)> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| {
            let tid = e.ok()?.file_name().into_string().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
            let comm = comm.trim().to_owned();
            prefixes
                .iter()
                .any(|p| comm.starts_with(p))
                .then(|| (comm, cpus_of(&tid)))
        })
        .collect()
}

const HELPERS: [&str; 3] = ["tz-ring", "tz-param-copy", "tierzero-optim"];

#[test]
fn helpers_run_on_their_cpus_and_the_stepping_thread_gets_its_own_mask_back() {
    let allowed = current_thread_cpus().unwrap();
    assert!(
        allowed.len() >= 2,
        "this test needs 2 CPUs (CI has 2); the mask allows {allowed:?}"
    );
    let dir = tiny_gpt2_dir("pin", 2, 32);

    // Everything on NVMe, one rank, one compute thread: "auto" pins it to
    // the first CPU and the helpers to the rest.
    let one = Knobs {
        compute_threads: Some(1),
        ..Knobs::nvme()
    };
    let mut t = build(&dir, &one, 1, 16, 2);
    let Placement::Pinned {
        compute_cpus,
        helper_cpus,
    } = t.placement().clone()
    else {
        panic!("auto did not pin: {}", t.placement());
    };
    let n = t.compute_threads().threads;
    assert_eq!(&compute_cpus[..], &allowed[..n]);
    assert_eq!(&helper_cpus[..], &allowed[n..]);
    // Run a step from a thread whose own mask is narrower than the
    // process's (one helper CPU): the step runs on the compute pool, and
    // the caller's mask is left alone.
    let own = vec![*allowed.last().unwrap()];
    let own2 = own.clone();
    let (t_back, before, after) = std::thread::spawn(move || {
        pin_current_thread(&own2).unwrap();
        let before = current_thread_cpus().unwrap();
        t.step().unwrap();
        let after = current_thread_cpus().unwrap();
        (t, before, after)
    })
    .join()
    .unwrap();
    assert_eq!(before, own);
    assert_eq!(after, own, "the step must give the caller its mask back");
    let threads = helpers(&HELPERS);
    for name in HELPERS {
        assert!(
            threads.iter().any(|(n, _)| n.starts_with(name)),
            "no {name} thread among {threads:?}"
        );
    }
    for (name, cpus) in &threads {
        assert_eq!(&cpus[..], &helper_cpus[..], "{name}");
    }
    // The compute pool's threads run on the compute CPUs.
    let compute = helpers(&["tierzero-cpu-"]);
    assert_eq!(compute.len(), n, "{compute:?}");
    for (name, cpus) in &compute {
        assert_eq!(&cpus[..], &compute_cpus[..], "{name}");
    }
    t_back.finish().unwrap();

    // false: nobody pinned, every helper may use every allowed CPU.
    let k = Knobs {
        pin_threads: Some(false),
        ..Knobs::nvme()
    };
    let mut t = build(&dir, &k, 1, 16, 2);
    assert!(matches!(t.placement(), Placement::Unpinned(_)));
    t.step().unwrap();
    let threads = helpers(&HELPERS);
    assert!(!threads.is_empty());
    for (name, cpus) in &threads {
        assert_eq!(cpus, &allowed, "{name}");
    }
    t.finish().unwrap();
}

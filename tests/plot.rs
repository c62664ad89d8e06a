//! `shardnet plot`: the logs of `--log-dir` as a crash and a resume leave
//! them (a cut last line, steps logged twice), a bad line refused naming
//! the file and line, and the charts written as PNGs.

use shardnet::Error;
use shardnet_cli::plot::{plot, read_log};
use std::fs;
use std::path::{Path, PathBuf};

mod common;
use common::shardnet;

/// A fresh, empty directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardnet-plot-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

/// One line of steps.jsonl, as the trainer writes it (memory on every 10th step).
fn step_line(step: u64, steps_per_epoch: u64, loss: f64) -> String {
    let memory = if step.is_multiple_of(10) {
        format!(
            ", \"memory_bytes\": [{}, {}]",
            100 << 20,
            (120 << 20) + step * 1000
        )
    } else {
        String::new()
    };
    format!(
        "{{\"step\": {step}, \"epoch\": {}, \"loss\": {loss}, \"accuracy\": {}, \
         \"samples_per_s\": {}, \"lr\": 0.001, \"loss_scale\": null, \
         \"bytes_received\": 4096, \"time_s\": {}{memory}}}\n",
        (step - 1) / steps_per_epoch + 1,
        (1.0 - loss / 3.0).clamp(0.0, 1.0),
        if step == 1 {
            "null".to_string()
        } else {
            format!("{}", 800.0 + (step % 7) as f64)
        },
        step as f64 * 0.01,
    )
}

/// One line of epochs.jsonl.
fn epoch_line(epoch: u64, step: u64, test: Option<f64>) -> String {
    let test = test.map_or("null".to_string(), |t| t.to_string());
    format!(
        "{{\"epoch\": {epoch}, \"step\": {step}, \"steps\": 60, \"train_loss\": {}, \
         \"train_accuracy\": 0.{epoch}, \"test_accuracy\": {test}, \"samples_per_s\": 800.0, \
         \"memory_bytes\": [{}, {}]}}\n",
        1.0 / epoch as f64,
        100 << 20,
        130 << 20
    )
}

/// Run `a`: 3 epochs of 60 steps, clean. Run `b`: crashed in step 100
/// (a cut last line), resumed from step 60 and ran to 120, so steps 61–99
/// and epoch 2 are logged twice (the second time with loss 0.5), and the
/// resumed run was cut short too.
fn two_runs(root: &Path) -> (PathBuf, PathBuf) {
    let a = root.join("a");
    let b = root.join("b");
    fs::create_dir_all(&a).unwrap();
    fs::create_dir_all(&b).unwrap();
    let mut steps = String::new();
    let mut epochs = String::new();
    for s in 1..=180 {
        steps += &step_line(s, 60, 2.3 / s as f64 + 0.05);
        if s % 60 == 0 {
            epochs += &epoch_line(s / 60, s, Some(0.9));
        }
    }
    fs::write(a.join("steps.jsonl"), steps).unwrap();
    fs::write(a.join("epochs.jsonl"), epochs).unwrap();
    fs::write(a.join("run.json"), r#"{"model": "mnist-mlp", "ranks": 2}"#).unwrap();

    let mut steps = String::new();
    let mut epochs = String::new();
    for s in 1..=99 {
        steps += &step_line(s, 60, 2.0);
        if s == 60 {
            epochs += &epoch_line(1, 60, None);
        }
    }
    // The crash, mid-line.
    steps += "{\"step\": 100, \"epoch\": 2, \"lo";
    steps += "\n";
    for s in 61..=120 {
        steps += &step_line(s, 60, 0.5);
    }
    epochs += &epoch_line(2, 120, Some(0.95));
    steps += &step_line(121, 60, 0.5)[..20];
    fs::write(b.join("steps.jsonl"), steps).unwrap();
    fs::write(b.join("epochs.jsonl"), epochs).unwrap();
    (a, b)
}

/// A resumed run's steps are deduplicated (the last line wins) and in
/// order; the cut last line is skipped with a note; a cut line in the
/// middle (the crash before the resume) is an error, naming file and line.
#[test]
fn read_log_keeps_the_last_of_each_step_and_skips_a_cut_last_line() {
    let root = scratch("read");
    let (a, b) = two_runs(&root);

    let log = read_log(&a).unwrap();
    assert_eq!(log.model.as_deref(), Some("mnist-mlp"));
    assert_eq!(log.steps.len(), 180);
    assert_eq!(log.epochs.len(), 3);
    assert!(log.skipped.is_empty(), "{:?}", log.skipped);
    assert_eq!(log.steps[0].samples_per_s, None);
    assert_eq!(
        log.steps[9].memory_bytes.as_deref().map(<[u64]>::len),
        Some(2)
    );
    assert_eq!(log.steps[8].memory_bytes, None);

    // b's line 100 is the crash: cut in the middle of the file.
    let err = read_log(&b).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Io(_)), "{err:?}");
    assert!(text.contains("steps.jsonl:100:"), "{text}");

    // Without it, b is the resumed run: the cut last line is skipped.
    let steps = fs::read_to_string(b.join("steps.jsonl")).unwrap();
    let fixed: Vec<&str> = steps.lines().filter(|l| !l.ends_with("\"lo")).collect();
    fs::write(b.join("steps.jsonl"), fixed.join("\n")).unwrap();
    let log = read_log(&b).unwrap();
    let numbers: Vec<u64> = log.steps.iter().map(|s| s.step).collect();
    assert_eq!(numbers, (1..=120).collect::<Vec<_>>());
    assert!(log.steps[..60].iter().all(|s| s.loss == Some(2.0)));
    assert!(log.steps[60..].iter().all(|s| s.loss == Some(0.5)));
    assert_eq!(log.steps[60].epoch, 2);
    assert_eq!(log.epochs.len(), 2);
    assert_eq!(log.epochs[0].test_accuracy, None);
    assert_eq!(log.epochs[1].test_accuracy, Some(0.95));
    assert_eq!(log.model, None);
    assert_eq!(log.skipped.len(), 1, "{:?}", log.skipped);
    assert!(
        log.skipped[0].contains("steps.jsonl:160:"),
        "{:?}",
        log.skipped
    );

    // The last line wins for an epoch, too.
    fs::write(
        b.join("epochs.jsonl"),
        epoch_line(1, 60, None) + &epoch_line(1, 60, Some(0.5)),
    )
    .unwrap();
    let log = read_log(&b).unwrap();
    assert_eq!(log.epochs.len(), 1);
    assert_eq!(log.epochs[0].test_accuracy, Some(0.5));
    let _ = fs::remove_dir_all(&root);
}

/// A line that is not a step (wrong type, missing field, not JSON) before
/// the last is refused, naming the file and its line; so is a directory
/// without steps.jsonl.
#[test]
fn bad_logs_are_refused_naming_the_file_and_line() {
    let root = scratch("bad");
    let good = step_line(1, 60, 1.0) + &step_line(2, 60, 1.0);
    for (bad, what) in [
        ("{\"step\": \"three\", \"epoch\": 1}", "invalid type"),
        ("{\"epoch\": 1, \"loss\": 1.0}", "missing field `step`"),
        ("not json", "expected"),
    ] {
        let text = format!("{}{bad}\n{}", step_line(1, 60, 1.0), good);
        fs::write(root.join("steps.jsonl"), text).unwrap();
        let err = read_log(&root).unwrap_err().to_string();
        let at = format!("{}:2:", root.join("steps.jsonl").display());
        assert!(err.contains(&at) && err.contains(what), "{bad}: {err}");
    }
    // In epochs.jsonl too.
    fs::write(root.join("steps.jsonl"), &good).unwrap();
    fs::write(
        root.join("epochs.jsonl"),
        "{\"epoch\": 1}\n{\"epoch\": 2}\n",
    )
    .unwrap();
    let err = read_log(&root).unwrap_err().to_string();
    assert!(
        err.contains("epochs.jsonl:1:") && err.contains("`step`"),
        "{err}"
    );

    let empty = root.join("empty");
    fs::create_dir_all(&empty).unwrap();
    let err = read_log(&empty).unwrap_err();
    let want = format!(
        "{} is not a --log-dir of shardnet train: no steps.jsonl",
        empty.display()
    );
    assert!(matches!(&err, Error::Usage(m) if *m == want), "{err:?}");
    assert!(read_log(&root.join("missing")).is_err());

    // Logged, but not one step yet: nothing to plot, said so.
    fs::write(empty.join("steps.jsonl"), "").unwrap();
    assert!(read_log(&empty).unwrap().steps.is_empty());
    let err = plot(std::slice::from_ref(&empty), &root.join("out"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no step logged yet"), "{err}");
    let _ = fs::remove_dir_all(&root);
}

/// `path` is a PNG of the chart size: the signature, and more than a
/// blank image's few hundred bytes.
fn assert_png(path: &Path) {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
    assert!(
        bytes.len() > 5000,
        "{}: {} bytes",
        path.display(),
        bytes.len()
    );
    // IHDR: width and height, big-endian, at bytes 16..24.
    assert_eq!(
        &bytes[16..24],
        &[0, 0, 3, 232, 0, 0, 2, 88],
        "{}",
        path.display()
    );
}

/// Two runs (one resumed and cut short) give the four charts, each a PNG,
/// written atomically (no temporary file left) into a directory created
/// for them; a run without memory figures still gets its memory chart.
#[test]
fn plot_writes_the_four_charts_as_png() {
    let root = scratch("charts");
    let (a, b) = two_runs(&root);
    // b without its mid-file crash line, as a resumed run's log is once
    // the trainer truncates it (its cut last line stays).
    let steps = fs::read_to_string(b.join("steps.jsonl")).unwrap();
    let fixed: Vec<&str> = steps.lines().filter(|l| !l.ends_with("\"lo")).collect();
    fs::write(b.join("steps.jsonl"), fixed.join("\n")).unwrap();

    let out = root.join("plots").join("both");
    let written = plot(&[a.clone(), b.clone()], &out).unwrap();
    let names: Vec<String> = written
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["loss.png", "accuracy.png", "throughput.png", "memory.png"]
    );
    for p in &written {
        assert_eq!(p.parent(), Some(out.as_path()));
        assert_png(p);
    }
    let mut files: Vec<_> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    files.sort();
    assert_eq!(files.len(), 4, "temporary files left: {files:?}");

    // One run with no memory figures at all, plotted into its own dir;
    // again (the files are replaced).
    let c = root.join("c");
    fs::create_dir_all(&c).unwrap();
    let steps: String = (1..=5).map(|s| step_line(s * 3 + 1, 60, 1.0)).collect();
    fs::write(c.join("steps.jsonl"), steps).unwrap();
    for _ in 0..2 {
        let written = plot(std::slice::from_ref(&c), &c).unwrap();
        assert_eq!(written.len(), 4);
        written.iter().for_each(|p| assert_png(p));
    }

    // The same name twice (a/log, b/log) still plots.
    for run in ["a", "b"] {
        let log = root.join("twice").join(run).join("log");
        fs::create_dir_all(&log).unwrap();
        fs::copy(a.join("steps.jsonl"), log.join("steps.jsonl")).unwrap();
    }
    let twice = [root.join("twice/a/log"), root.join("twice/b/log")];
    assert_eq!(plot(&twice, &root.join("twice")).unwrap().len(), 4);

    // --out naming a file is refused, naming it.
    let file = root.join("a-file");
    fs::write(&file, "x").unwrap();
    let err = plot(&[a], &file).unwrap_err().to_string();
    assert!(
        err.contains("a-file") && err.contains("not a directory"),
        "{err}"
    );
    let _ = fs::remove_dir_all(&root);
}

/// The command: the files written are printed, a cut last line is a note;
/// a missing directory or one that is no --log-dir fails with a message
/// naming it; no directory at all is a usage error.
#[test]
fn the_plot_command() {
    let root = scratch("cli");
    let (a, _) = two_runs(&root);
    fs::write(a.join("steps.jsonl"), step_line(1, 60, 1.0) + "{\"st").unwrap();
    let out = root.join("out");
    let (o, text) = shardnet(&["plot", a.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains(&format!("wrote {}", out.join("memory.png").display())),
        "{text}"
    );
    assert!(
        text.contains("steps.jsonl:2:") && text.contains("skipped"),
        "{text}"
    );
    assert_png(&out.join("loss.png"));

    // Default --out: the (first) directory.
    let (o, text) = shardnet(&["plot", a.to_str().unwrap()]);
    assert!(o.status.success(), "{text}");
    assert_png(&a.join("accuracy.png"));

    let missing = root.join("no-such-run");
    let (o, text) = shardnet(&["plot", missing.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        text.contains(&format!("{}: no such directory", missing.display())),
        "{text}"
    );
    let (o, text) = shardnet(&["plot", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text.contains("no steps.jsonl"), "{text}");
    let (o, text) = shardnet(&["plot"]);
    assert!(!o.status.success());
    assert!(text.contains("<DIR>..."), "{text}");
    let _ = fs::remove_dir_all(&root);
}

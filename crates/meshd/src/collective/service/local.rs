//! The local phase of a collective: the local ranks' buffers read, reduced and written
//! back, on several threads for large buffers.

use super::*;

use super::part::{Data, Part, cma_error};

/// Buffers from this size up are read, reduced and written back by several threads.
pub(super) const PARALLEL_FROM: usize = 4 << 20;
/// Other local ranks' buffers are read and reduced this much at a time (stays in cache).
pub(super) const SLICE: usize = 1 << 20;

/// Threads for the local phase of a `len`-byte collective (one per core, at most 8): the
/// local phase is memory-bound work that splits evenly, and a node with eight ranks has
/// four times the bytes of one with two to move (docs/PERFORMANCE.md, "Local ranks").
pub(super) fn local_threads(len: usize) -> usize {
    if len < PARALLEL_FROM {
        return 1;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.min(8).min(len / SLICE).max(1)
}

/// Slices of a `len`-byte buffer for `threads` workers: page-aligned, so a multiple of
/// every element size.
pub(super) fn slice_len(len: usize, threads: usize) -> usize {
    len.div_ceil(threads.max(1)).div_ceil(4096).max(1) * 4096
}

/// Runs the jobs, on scoped threads when there is more than one; results in job order.
pub(super) fn on_threads<T: Send>(jobs: Vec<impl FnOnce() -> T + Send>) -> Vec<Result<T, String>> {
    if jobs.len() <= 1 {
        return jobs.into_iter().map(|j| Ok(j())).collect();
    }
    let run = move || {
        std::thread::scope(|s| {
            let handles: Vec<_> = jobs.into_iter().map(|j| s.spawn(j)).collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| "a local worker thread panicked".to_string()))
                .collect()
        })
    };
    // Blocking work: let the runtime move its other tasks off this worker meanwhile.
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
        _ => run(),
    }
}

/// `acc` = the local ranks' buffers reduced with `op`, read a slice at a time.
pub(super) fn gather_local(parts: &[Part], acc: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), String> {
    let each = |off: usize, dst: &mut [u8]| -> Result<(), String> {
        parts[0].data.read(off, dst)?;
        let mut scratch = vec![0u8; SLICE.min(dst.len())];
        for p in &parts[1..] {
            for o in (0..dst.len()).step_by(SLICE) {
                let k = SLICE.min(dst.len() - o);
                p.data.read(off + o, &mut scratch[..k])?;
                reduce::reduce_into(dtype, op, &mut dst[o..o + k], &scratch[..k])
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    };
    let per = slice_len(acc.len(), local_threads(acc.len()));
    let each = &each;
    let jobs: Vec<_> = acc.chunks_mut(per).enumerate().map(|(i, dst)| move || each(i * per, dst)).collect();
    on_threads(jobs).into_iter().try_for_each(|r| r.and_then(|r| r))
}

/// Writes `result` into every in-place rank's buffer; one outcome per part (a rank that
/// died does not fail the others).
pub(super) fn write_back(parts: &[Part], result: &[u8]) -> Vec<Result<(), String>> {
    if !parts.iter().any(|p| matches!(p.data, Data::InPlace(_))) {
        return vec![Ok(()); parts.len()];
    }
    let write = |off: usize, src: &[u8]| -> Vec<Result<(), String>> {
        parts
            .iter()
            .map(|p| match &p.data {
                Data::InPlace(r) => {
                    // Held while writing: a rank that gave up gets nothing written after.
                    let gave_up = p.gave_up.lock();
                    if *gave_up {
                        return Err(format!("rank {} gave up on this collective", p.global));
                    }
                    cma::write(r, off, src).map_err(|e| cma_error(r, &e))
                }
                Data::Sent(_) => Ok(()),
            })
            .collect()
    };
    let per = slice_len(result.len(), local_threads(result.len()));
    let write = &write;
    let jobs: Vec<_> = result.chunks(per).enumerate().map(|(i, src)| move || write(i * per, src)).collect();
    let per_slice = on_threads(jobs);
    let mut out = vec![Ok(()); parts.len()];
    for slice in per_slice {
        match slice {
            Ok(results) => {
                for (o, r) in out.iter_mut().zip(results) {
                    if o.is_ok() {
                        *o = r;
                    }
                }
            }
            Err(e) => out.iter_mut().for_each(|o| *o = Err(e.clone())),
        }
    }
    out
}

//! Measuring the GPU's work: timing events ([`Stamp`], [`Gpu::time_ms`]), the profiler range
//! ([`Gpu::profile`]), and the launch records of a timeline build ([`Timeline`]).

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaEvent, DriverError};

use super::{Gpu, view_refused};
use crate::error::{During, Result};

/// What [`Gpu::timeline`] read: one record per launch, in the order their block 0 started.
#[derive(Clone, Debug)]
pub struct Timeline {
    /// Our kernels of the last capture, in launch order (the records' order, where the
    /// records are of a replay of that capture).
    pub kernels: Vec<&'static str>,
    pub records: Vec<Launch>,
}

/// One launch of a [`Timeline`]: global timer nanoseconds when its block 0 started and when its
/// wait on the kernel before returned (that kernel's end, give or take its memory flush).
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    pub start_ns: u64,
    pub go_ns: u64,
    pub grid: (u32, u32),
    pub block: u32,
}

/// A point in a [`Gpu`]'s stream ([`Gpu::stamp`]): a CUDA event with timing, for the GPU time
/// between two points of one stream's work.
pub struct Stamp(CudaEvent);

impl Stamp {
    /// Milliseconds of GPU time from `earlier` to this stamp; waits until the work before both
    /// is done. The events' resolution is about half a microsecond.
    pub fn ms_since(&self, earlier: &Stamp) -> Result<f32> {
        earlier.0.elapsed_ms(&self.0).during("reading a timing event")
    }
}

impl Gpu {
    /// Runs `f` with the CUDA profiler on: the range a profiler started with collection off
    /// (`ncu --profile-from-start off`) records.
    pub fn profile<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        self.ctx.bind_to_thread().during("binding the context")?;
        // SAFETY: plain driver calls without arguments, on a bound context.
        unsafe { sys::cuProfilerStart() }.result().during("starting the profiler")?;
        let out = f();
        // SAFETY: as above.
        unsafe { sys::cuProfilerStop() }.result().during("stopping the profiler")?;
        Ok(out)
    }

    /// The launch records since the last call (then cleared), and the kernels of the last
    /// capture in order: a decode step's timeline where the PTX was built with
    /// `NEMO_TIMELINE` set (kernels-gpu's `timeline` feature: block 0 of every launch records
    /// when it started and when its wait on the kernel before returned); `None` without it.
    /// cuBLASLt's kernels record nothing: they fall between two records.
    pub fn timeline(&self) -> Result<Option<Timeline>> {
        self.not_capturing("reading the timeline")?;
        self.ctx.bind_to_thread().during("binding the context")?;
        let mut n = match self._module.get_global("TIMELINE_N", &self.stream) {
            Err(DriverError(CUresult::CUDA_ERROR_NOT_FOUND)) => return Ok(None),
            r => r.during("finding the timeline")?,
        };
        let mut count = [0u8; 4];
        self.stream.memcpy_dtoh(&n, &mut count[..]).during("reading the timeline")?;
        let mut t = self._module.get_global("TIMELINE", &self.stream).during("finding the timeline")?;
        let len = (u32::from_le_bytes(count) as usize).min(t.len() / 32);
        let mut raw = vec![0u64; 4 * len];
        // SAFETY: the global is an array of u64 (4 per record).
        let words =
            unsafe { t.transmute_mut::<u64>(t.len() / 8) }.ok_or_else(|| view_refused("reading the timeline"))?;
        self.stream.memcpy_dtoh(&words.slice(..4 * len), &mut raw[..]).during("reading the timeline")?;
        self.stream.memcpy_htod(&[0u8; 4], &mut n).during("resetting the timeline")?;
        self.stream.synchronize().during("reading the timeline")?;
        let records = raw
            .chunks(4)
            .map(|c| Launch {
                start_ns: c[0],
                go_ns: c[1],
                grid: (c[2] as u32, (c[2] >> 32) as u32),
                block: c[3] as u32,
            })
            .collect();
        let kernels = self.captured.lock().map(|k| k.clone()).unwrap_or_default();
        Ok(Some(Timeline { kernels, records }))
    }

    /// GPU time in milliseconds of the work `f` queues, between two CUDA events on the stream.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags).during("recording a timing event")?;
        f()?;
        let end = self.stream.record_event(flags).during("recording a timing event")?;
        end.synchronize().during("waiting for a timing event")?;
        start.elapsed_ms(&end).during("reading a timing event")
    }

    /// A timing event recorded on the stream after the work queued so far (see [`Stamp`]);
    /// refused while a capture records (an event in a graph times nothing).
    pub fn stamp(&self) -> Result<Stamp> {
        self.not_capturing("a timing event")?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        Ok(Stamp(self.stream.record_event(flags).during("recording a timing event")?))
    }
}

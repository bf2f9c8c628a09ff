// taco_symm.cu — the native half of the symmetric-memory transport (taco_symm.py): a barrier of the
// ranks on their signal pads, and the whole all-reduce in one binding call (replayed as a CUDA graph).
// It runs taco_kernels.cu's kernels on messages at the peers' addresses (TacoMsgs.ptr).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <functional>
#include <map>

#include "taco_binding.h"

namespace {
using namespace taco_binding;

// The ranks' signal pads (PyTorch's symmetric memory maps one beside each buffer): pad[r] is rank
// r's, and the flag that rank `src` raises for rank r in channel ch is pad[r][W * ch + src].
struct TacoPads {
  uint32_t* pad[TACO_MAX_PEERS];
  int W;
};

// --- the barrier: one thread per peer ---------------------------------------------------------------

__device__ __forceinline__ uint32_t cas_release(uint32_t* a, uint32_t from, uint32_t to) {
  uint32_t old;
  asm volatile("atom.release.sys.global.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(a), "r"(from), "r"(to) : "memory");
  return old;
}

__device__ __forceinline__ uint32_t cas_acquire(uint32_t* a, uint32_t from, uint32_t to) {
  uint32_t old;
  asm volatile("atom.acquire.sys.global.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(a), "r"(from), "r"(to) : "memory");
  return old;
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Rank `me` raises its flag in every peer's pad (0 -> 1, release), then waits for and lowers every
// peer's flag in its own (1 -> 0, acquire). The flags and their protocol are PyTorch's
// symmetric-memory barrier's, so the two can be mixed. A peer that has not come after 10 minutes
// stops the kernel with an error.
__global__ void barrier_kernel(TacoPads pads, int me, int channel) {
  const int peer = threadIdx.x, W = pads.W;
  if (peer >= W || peer == me) return;
  uint32_t *theirs = pads.pad[0], *mine = pads.pad[0];       // constant indices (no local memory)
#pragma unroll
  for (int k = 1; k < TACO_MAX_PEERS; k++) {
    theirs = peer == k ? pads.pad[k] : theirs;
    mine = me == k ? pads.pad[k] : mine;
  }
  const unsigned long long t0 = now_ns(), limit = 600ull * 1000000000ull;
  bool ok = true;
  // my flag in the peer's pad: still 1 while the peer has not passed this channel's previous barrier
  while (ok && cas_release(theirs + W * channel + me, 0, 1) != 0) ok = now_ns() - t0 < limit;
  while (ok && cas_acquire(mine + W * channel + peer, 1, 0) != 1) ok = now_ns() - t0 < limit;
  if (ok) return;
  printf("taco: rank %d waited 10 minutes at a barrier for rank %d (a collective that not every rank called?)\n",
         me, peer);
  __trap();
}

void barrier(const TacoPads& pads, int me, int channel) {
  barrier_kernel<<<1, 32, 0, c10::cuda::getCurrentCUDAStream()>>>(pads, me, channel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// --- from Python ------------------------------------------------------------------------------------

// 1 to TACO_MAX_PEERS device addresses (what: their name in the error) into dst; returns how many
template <typename T>
int addresses(const std::vector<int64_t>& ptrs, T* (&dst)[TACO_MAX_PEERS], const char* what) {
  TORCH_CHECK(!ptrs.empty() && ptrs.size() <= TACO_MAX_PEERS, "taco: 1 to ", TACO_MAX_PEERS, " ", what);
  for (size_t i = 0; i < ptrs.size(); i++) dst[i] = reinterpret_cast<T*>(ptrs[i]);
  return (int)ptrs.size();
}

// message m at address ptrs[m]: buffers in the peers' symmetric memory (the caller keeps them alive)
TacoMsgs scattered(const std::vector<int64_t>& ptrs) {
  TacoMsgs m{nullptr, {}, 0};
  m.n_ptr = addresses(ptrs, m.ptr, "message pointers");
  return m;
}

// rank r's signal pad at address ptrs[r] (PyTorch's symmetric memory: the handle's signal_pad_ptrs)
TacoPads signal_pads(const std::vector<int64_t>& ptrs) {
  TacoPads s{{}, 0};
  s.W = addresses(ptrs, s.pad, "signal pads");
  return s;
}

// Stream `waiter` waits for the work queued on `done` so far (an event recorded there), both on the
// current device: one event per device, reused, as each record is waited on at once.
void wait_for(cudaStream_t waiter, cudaStream_t done) {
  static cudaEvent_t events[64] = {};
  const int dev = c10::cuda::current_device();
  TORCH_CHECK(dev < 64, "taco: device index ", dev, " >= 64");
  if (!events[dev]) C10_CUDA_CHECK(cudaEventCreateWithFlags(&events[dev], cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(events[dev], done));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, events[dev], 0));
}

using StreamId = std::tuple<int64_t, int64_t, int64_t>;    // torch.cuda.Stream's (stream_id, device_index, device_type)

c10::cuda::CUDAStream unpack(const StreamId& s) {
  return c10::cuda::CUDAStream::unpack3(std::get<0>(s), std::get<1>(s), static_cast<c10::DeviceType>(std::get<2>(s)));
}

// One plan's all-reduce captured as CUDA graphs, one per (tensor address, dtype): a later eager call
// on the same tensor costs one graph launch instead of five kernel launches. At most kMax graphs;
// past that (addresses that keep changing), calls launch the kernels one by one.
class Replays {
 public:
  static constexpr size_t kMax = 64;
  ~Replays() {
    for (auto& kv : execs_) cudaGraphExecDestroy(kv.second);     // one still running is freed when done
  }
  // the graph for x; if new, captured now from launch_all() on the current stream cs (work already
  // queued there is not part of it)
  cudaGraphExec_t get(const torch::Tensor& x, cudaStream_t cs, const std::function<void()>& launch_all) {
    const auto key = std::make_pair(x.data_ptr(), dtype_code(x));
    const auto it = execs_.find(key);
    if (it != execs_.end()) return it->second;
    if (execs_.size() >= kMax) return nullptr;
    C10_CUDA_CHECK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t graph = nullptr;
    try {
      launch_all();
    } catch (...) {                                                // a failed check: end the capture
      if (cudaStreamEndCapture(cs, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
      throw;
    }
    C10_CUDA_CHECK(cudaStreamEndCapture(cs, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    C10_CUDA_CHECK(err);
    return execs_[key] = exec;
  }

 private:
  std::map<std::pair<void*, int>, cudaGraphExec_t> execs_;
};

// The one way onto a workspace's side stream: stream `side` waits for the caller's, runs work() as the
// current stream, and the caller's stream is current again (also after an error); with join it waits
// for what `side` queued, else it joins later (join_stream, at handle.wait()).
template <typename Work>
void on_side(const StreamId& side, bool join, const Work& work) {
  const c10::cuda::CUDAStream s = unpack(side);
  const c10::cuda::CUDAGuard guard(s.device_index());
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream();
  wait_for(s.stream(), caller.stream());                                  // the input is ready
  {
    const c10::cuda::CUDAStreamGuard on(s);
    work();
  }
  if (join) wait_for(caller.stream(), s.stream());
}

// The symmetric-memory all-reduce of taco_symm.py in one call, so that an eager call costs one graph
// launch (replay: a graph per tensor, Replays) or five kernel launches, not a dozen Python steps:
// encode x into my A (one message per rank), barrier(0), reduce every peer's A[me] into my B,
// barrier(1), decode every peer's B into x. On the workspace's stream `side` (on_side; join: the
// caller's stream waits for it now); while that stream is being captured into a graph (the caller's
// is), the kernels are launched one by one (into that graph).
void two_shot_peers(torch::Tensor x, torch::Tensor a, torch::Tensor b, const TacoMsgs& mine, const TacoMsgs& every,
                    const TacoPads& pads, int64_t me, const TacoParams& p, Replays& replays, bool replay,
                    const StreamId& side, bool join) {
  check(x, "input");
  TORCH_CHECK(x.get_device() == std::get<1>(side), "taco: the tensor is not on the workspace's GPU");
  const auto launch_all = [&] {
    encode(x, mine.n_ptr, p, a);
    barrier(pads, (int)me, 0);
    reduce_encode(mine, mine.n_ptr, b, p);
    barrier(pads, (int)me, 1);
    decode(every, every.n_ptr, x, p);
  };
  on_side(side, join, [&] {
    const cudaStream_t s = c10::cuda::getCurrentCUDAStream();
    cudaStreamCaptureStatus capturing;
    C10_CUDA_CHECK(cudaStreamIsCapturing(s, &capturing));
    const bool own_graph = replay && capturing == cudaStreamCaptureStatusNone;
    const cudaGraphExec_t exec = own_graph ? replays.get(x, s, launch_all) : nullptr;
    if (exec) {
      C10_CUDA_CHECK(cudaGraphLaunch(exec, s));
    } else {
      launch_all();
    }
  });
}

}  // namespace

// called from taco_binding.cpp's module definition
void bind_symm(pybind11::module_& m) {
  py::class_<TacoMsgs>(m, "Msgs").def(py::init(&scattered), "messages at the given device addresses");
  py::class_<Replays>(m, "Replays").def(py::init<>(), "a plan's all-reduce as CUDA graphs, one per tensor");
  py::class_<TacoPads>(m, "Pads").def(py::init(&signal_pads), "the ranks' signal pads at the given device addresses");
  m.def("two_shot_peers", &two_shot_peers, "the symmetric-memory all-reduce: encode, barrier, reduce, barrier, "
        "decode", py::arg("x"), py::arg("a"), py::arg("b"), py::arg("mine"), py::arg("every"), py::arg("pads"),
        py::arg("me"), py::arg("p"), py::arg("replays"), py::arg("replay"), py::arg("side"), py::arg("join"));
  m.def("on_side", [](const StreamId& side, bool join, const py::function& work) { on_side(side, join, work); },
        "work() on stream `side`, after the current stream's work; join: the current stream waits for it");
  m.def("barrier", [](const TacoPads& pads, int64_t me, int64_t channel) {
    TORCH_CHECK(0 <= me && me < pads.W && channel >= 0, "taco: barrier of rank ", me, " of ", pads.W, ", channel ",
                channel);
    barrier(pads, (int)me, (int)channel);
  }, "a barrier of the ranks, on the current stream: rank `me` of pads.W, on the given channel (0, 1, ...)");
  m.def("join_stream", [](const StreamId& side) {
    const c10::cuda::CUDAStream s = unpack(side);
    const c10::cuda::CUDAGuard guard(s.device_index());
    wait_for(c10::cuda::getCurrentCUDAStream(), s.stream());
  }, "the current stream (of `side`'s device) waits for the work queued so far on stream `side`");
  m.def("decode_peers", [](std::vector<int64_t> ptrs, torch::Tensor out, const TacoParams& p) {
    return decode(scattered(ptrs), ptrs.size(), out, p);
  }, "fused decompress of messages at the given device addresses into out");
}

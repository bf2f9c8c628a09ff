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

void barrier(const TacoPads& pads, int me, int channel, cudaStream_t st) {
  barrier_kernel<<<1, 32, 0, st>>>(pads, me, channel);
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
  // the graph for x; if new, captured now from launch_all(cs) on stream cs (work already
  // queued there is not part of it)
  cudaGraphExec_t get(const torch::Tensor& x, cudaStream_t cs,
                      const std::function<void(cudaStream_t)>& launch_all) {
    const auto key = std::make_pair(x.data_ptr(), dtype_code(x));
    const auto it = execs_.find(key);
    if (it != execs_.end()) return it->second;
    if (execs_.size() >= kMax) return nullptr;
    C10_CUDA_CHECK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t graph = nullptr;
    try {
      launch_all(cs);
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

// One all-reduce size's plan, taco_symm.make_plan fills it by name: my buffers, the peers' messages, the
// codec's parameters, the workspace's stream and the all-reduce's CUDA graphs.
struct TwoShotPlan {
  torch::Tensor sends;   // in my symmetric buffer: my W messages, message q for rank q
  torch::Tensor shard;   // after them: my reduced shard's message
  TacoMsgs mine;         // message `me` of every rank's sends: what I reduce
  TacoMsgs every;        // every rank's shard: what I decode
  TacoPads pads;         // the ranks' signal pads (the two barriers)
  int64_t me = 0;        // my rank in the group
  TacoParams p{};        // the codec, for messages of p.L elements and p.S bytes
  StreamId side{};       // the workspace's stream: torch.cuda.Stream's (stream_id, device_index, device_type)
  Replays replays;       // the all-reduce as CUDA graphs, one per tensor (made on first use)
  TwoShotPlan() = default;
  TwoShotPlan(const TwoShotPlan&) = delete;   // the graphs are owned once
};

// The symmetric-memory all-reduce of taco_symm.py in one call, so that an eager call costs one graph
// launch (replay: a graph per tensor, Replays) or five kernel launches, not a dozen Python steps:
// encode x into my sends (one message per rank), barrier(0), reduce every rank's message for me into
// my shard, barrier(1), decode every rank's shard into x. On the workspace's stream, after the
// caller's work so far; join: the caller's stream waits for it now (else at handle.wait(),
// join_stream). While the caller's stream is being captured into a graph, the side stream joins that
// capture and the kernels are launched one by one into it.
void two_shot(torch::Tensor x, TwoShotPlan& plan, bool replay, bool join) {
  check(x, "input");
  const int W = plan.mine.n_ptr, xdt = dtype_code(x);
  TORCH_CHECK(x.get_device() == std::get<1>(plan.side), "taco: the tensor is not on the workspace's GPU");
  TORCH_CHECK(plan.sends.numel() == W * plan.p.S && plan.shard.numel() == plan.p.S && x.numel() <= W * plan.p.L,
              "taco: the plan's buffers do not fit its messages, or the tensor its shards");
  const auto launch_all = [&](cudaStream_t st) {
    uint8_t *sends = plan.sends.data_ptr<uint8_t>(), *shard = plan.shard.data_ptr<uint8_t>();
    TORCH_CHECK(taco_encode(x.data_ptr(), xdt, x.numel(), W, plan.p, sends, st), UNSUPPORTED);   // Eq. 6-10
    barrier(plan.pads, (int)plan.me, 0, st);
    TORCH_CHECK(taco_reduce_encode(plan.mine, W, plan.p, shard, st), UNSUPPORTED);
    barrier(plan.pads, (int)plan.me, 1, st);
    TORCH_CHECK(taco_decode(plan.every, W, plan.p, x.data_ptr(), xdt, x.numel(), st), UNSUPPORTED);   // Eq. 11-13
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const c10::cuda::CUDAStream side = unpack(plan.side);
  const c10::cuda::CUDAGuard guard(side.device_index());
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream().stream(), st = side.stream();
  wait_for(st, caller);                                                   // x is ready
  cudaStreamCaptureStatus capturing;
  C10_CUDA_CHECK(cudaStreamIsCapturing(st, &capturing));
  const cudaGraphExec_t exec =
      replay && capturing == cudaStreamCaptureStatusNone ? plan.replays.get(x, st, launch_all) : nullptr;
  if (exec) {
    C10_CUDA_CHECK(cudaGraphLaunch(exec, st));
  } else {
    launch_all(st);
  }
  if (join) wait_for(caller, st);
}

}  // namespace

// called from taco_binding.cpp's module definition
void bind_symm(pybind11::module_& m) {
  py::class_<TacoMsgs>(m, "Msgs").def(py::init(&scattered), "messages at the given device addresses");
  py::class_<TacoPads>(m, "Pads").def(py::init(&signal_pads), "the ranks' signal pads at the given device addresses");
#define FIELD(name) .def_readwrite(#name, &TwoShotPlan::name)      // the same name on both sides
  py::class_<TwoShotPlan>(m, "TwoShotPlan").def(py::init<>()) FIELD(sends) FIELD(shard) FIELD(mine) FIELD(every)
      FIELD(pads) FIELD(me) FIELD(p) FIELD(side);
#undef FIELD
  m.def("two_shot", &two_shot, "the symmetric-memory all-reduce of x by its plan: encode, barrier, reduce, barrier, "
        "decode", py::arg("x"), py::arg("plan"), py::arg("replay") = true, py::arg("join") = true);
  m.def("on_side", [](const StreamId& side, bool join, const py::function& work) { on_side(side, join, work); },
        "work() on stream `side`, after the current stream's work; join: the current stream waits for it");
  m.def("barrier", [](const TacoPads& pads, int64_t me, int64_t channel) {
    TORCH_CHECK(0 <= me && me < pads.W && channel >= 0, "taco: barrier of rank ", me, " of ", pads.W, ", channel ",
                channel);
    barrier(pads, (int)me, (int)channel, c10::cuda::getCurrentCUDAStream());
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

// The C++ CUDA impls of the one-launch torch.ops.h3 calls: validate, allocate, launch, all without
// entering Python. A Python CUDA impl costs a dispatcher round trip into Python, the Python checks, a
// Python torch.empty and tvm-ffi's Python argument conversion; on a slow host that is most of a small
// op's time. Here the compiled CuTe DSL kernel (a tvm-ffi function) is called through its C ABI with
// DLTensor views of the torch tensors, on torch's current stream.
//
// Python keeps every decision that is not the fast path: any input the fast predicate does not accept
// goes to the op's Python CUDA impl, which widens, refuses with the exact message of
// h3cute.ops.validate, or runs; the compiled kernel is looked up once per (device, variant) through
// the Python runtime (prebuilt bundle, disk cache or JIT), which keeps the function alive.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <atomic>
#include <string>

namespace py = pybind11;

namespace h3native {

constexpr int kMaxDevices = 64;
constexpr int64_t kSinusoidWidth = 256;  // h3cute.ops.validate.FREQ

DLDataType dl_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DLDataType{kDLFloat, 32, 1};
    case at::kBFloat16: return DLDataType{kDLBfloat, 16, 1};
    case at::kLong: return DLDataType{kDLInt, 64, 1};
    default: TORCH_CHECK(false, "h3cute native: no DLPack dtype for ", t.scalar_type());
  }
}

// A borrowed DLTensor view of a CUDA tensor (valid while the tensor lives).
DLTensor dl_view(const at::Tensor& t) {
  DLTensor d;
  d.data = t.data_ptr();
  d.device = DLDevice{kDLCUDA, static_cast<int32_t>(t.get_device())};
  d.ndim = static_cast<int32_t>(t.dim());
  d.dtype = dl_dtype(t);
  d.shape = const_cast<int64_t*>(t.sizes().data());
  d.strides = const_cast<int64_t*>(t.strides().data());
  d.byte_offset = 0;
  return d;
}

TVMFFIAny any_tensor(DLTensor* d) {
  TVMFFIAny a;
  a.type_index = kTVMFFIDLTensorPtr;
  a.zero_padding = 0;
  a.v_ptr = d;
  return a;
}

// Runs a compiled kernel on torch's current stream of `device`; a kernel error becomes a RuntimeError.
void call_kernel(TVMFFIObjectHandle fn, TVMFFIAny* args, int32_t num_args, int device) {
  c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  void* stream = guard.getStream(c10::Device(c10::DeviceType::CUDA, device)).native_handle();
  TVMFFIStreamHandle previous = nullptr;
  TVMFFIEnvSetStream(kDLCUDA, device, stream, &previous);
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  int rc = TVMFFIFunctionCall(fn, args, num_args, &result);
  TVMFFIEnvSetStream(kDLCUDA, device, previous, nullptr);
  if (rc != 0) {
    TVMFFIObjectHandle err = nullptr;
    TVMFFIErrorMoveFromRaised(&err);
    std::string msg = "h3cute kernel call failed";
    if (err != nullptr) {
      TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
      msg = std::string(cell->kind.data, cell->kind.size) + ": " +
            std::string(cell->message.data, cell->message.size);
      TVMFFIObjectDecRef(err);
    }
    TORCH_CHECK(false, msg);
  }
}

// (device, variant) -> tvm-ffi function handle, filled once from `<module>.kernel_handle(device, variant)`.
template <int Variants>
class KernelSlots {
 public:
  explicit KernelSlots(const char* module) : module_(module) {}

  TVMFFIObjectHandle get(int device, int variant) {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "h3cute native: CUDA device index ", device);
    void* fn = slots_[device][variant].load(std::memory_order_acquire);
    if (fn != nullptr) return fn;
    // Under the GIL only (no mutex: the lookup may release the GIL while it compiles); two threads that
    // miss together both get the same function, which the Python runtime memoizes and keeps alive.
    py::gil_scoped_acquire gil;
    auto handle = py::module_::import(module_).attr("kernel_handle")(device, variant).cast<uintptr_t>();
    fn = reinterpret_cast<void*>(handle);
    slots_[device][variant].store(fn, std::memory_order_release);
    return fn;
  }

 private:
  const char* module_;
  std::atomic<void*> slots_[kMaxDevices][Variants] = {};
};

// ---- timestep_sinusoid ------------------------------------------------------------------------------

KernelSlots<2> sinusoid_kernels("h3cute.launch.timestep_sinusoid");  // variant = check_range

at::Tensor timestep_sinusoid_python(const at::Tensor& t, bool check_range) {
  py::gil_scoped_acquire gil;
  return py::module_::import("h3cute.ops.timestep").attr("_sinusoid_cuda")(t, check_range).cast<at::Tensor>();
}

at::Tensor timestep_sinusoid_cuda(const at::Tensor& t, bool check_range) {
  // Fast path: 1-D contiguous FP32, no gradient asked for. Anything else (widening, errors with their
  // messages, the no-gradient refusal) is the Python impl's.
  const bool fast = t.dim() == 1 && t.scalar_type() == at::kFloat && (t.size(0) <= 1 || t.stride(0) == 1) &&
                    !(t.requires_grad() && at::GradMode::is_enabled());
  if (!fast) return timestep_sinusoid_python(t, check_range);
  const int64_t rows = t.size(0);
  at::Tensor out = at::empty({rows, kSinusoidWidth}, t.options());
  if (rows == 0) return out;  // a zero-sized grid is not a valid launch
  const int device = t.get_device();
  DLTensor dt = dl_view(t), dout = dl_view(out);
  TVMFFIAny args[2] = {any_tensor(&dt), any_tensor(&dout)};
  call_kernel(sinusoid_kernels.get(device, check_range ? 1 : 0), args, 2, device);
  return out;
}

// The ops this library implements; h3cute.ops registers no Python CUDA impl for them.
const char* const kNativeOps[] = {"timestep_sinusoid"};

void install() {
  static torch::Library* lib = nullptr;
  if (lib != nullptr) return;
  lib = new torch::Library(torch::Library::IMPL, "h3", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  lib->impl("timestep_sinusoid", TORCH_FN(timestep_sinusoid_cuda));
}

}  // namespace h3native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "h3cute's C++ CUDA impls of the one-launch torch.ops.h3 calls";
  m.def("install", &h3native::install, "register the CUDA impls with the h3 library (after its ops are defined)");
  py::list ops;
  for (const char* op : h3native::kNativeOps) ops.append(op);
  m.attr("OPS") = ops;
}

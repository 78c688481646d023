// The C++ CUDA impls of the one-launch torch.ops.h3 calls: validate, allocate, launch, all without
// entering Python. A Python CUDA impl costs a dispatcher round trip into Python, the Python checks, a
// Python torch.empty and tvm-ffi's Python argument conversion; on a slow host that is most of a small
// op's time. Here the compiled CuTe DSL kernel (a tvm-ffi function) is called through its C ABI with
// DLTensor views of the torch tensors, on torch's current stream.
//
// Python keeps every decision that is not the fast path: any input the fast predicate does not accept
// goes to the op's Python CUDA impl, which widens, refuses with the exact message of
// h3cute.ops.validate, or runs. Every op is on launch plans (h3cute/launch/plan.py): an impl here is its fast-path
// predicate and a walk of the plans Python wrote (PlanTable, walk), fetched once per (device, phase, key, row range)
// with the compiled kernels' handles, which the Python runtime (prebuilt bundle, disk cache or JIT) keeps alive;
// no launch sequence is written here.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace h3native {

constexpr int kMaxDevices = 64;

// H3's widths and the launchers' constants that this file computes with. None is declared here: Python hands them
// over once, at load, before any impl is registered (install(constants), h3cute.native.constants(): from
// h3cute.widths and the launch modules).
struct Constants {
  // h3cute.widths
  int64_t hidden, freq, mlp_hidden, temb, block_chunks, block_table, block_projection, final_projection;
  // launch/norm_modulate.py: the largest of FUSED_CAPS, MAX_TABLE_ROWS
  int64_t max_fused_table_rows, max_table_rows;
  // h3cute.widths.LINEAR_SHAPES: h3::linear's weight shapes (N, K), the ones its fast path serves
  std::vector<std::pair<int64_t, int64_t>> linear_shapes;
};
Constants h3;

// Reads `constants` (name -> int) into h3: every field present, nothing else.
void configure(const py::dict& constants) {
  const std::pair<const char*, int64_t*> fields[] = {
      {"hidden", &h3.hidden}, {"freq", &h3.freq}, {"mlp_hidden", &h3.mlp_hidden}, {"temb", &h3.temb},
      {"block_chunks", &h3.block_chunks}, {"block_table", &h3.block_table},
      {"block_projection", &h3.block_projection}, {"final_projection", &h3.final_projection},
      {"max_fused_table_rows", &h3.max_fused_table_rows}, {"max_table_rows", &h3.max_table_rows}};
  TORCH_CHECK(constants.size() == std::size(fields) + 1, "h3cute native: install() takes ", std::size(fields) + 1,
              " constants, got ", constants.size());
  for (const auto& [name, field] : fields) {
    TORCH_CHECK(constants.contains(name), "h3cute native: install() constants lack '", name, "'");
    *field = constants[name].cast<int64_t>();
  }
  TORCH_CHECK(constants.contains("linear_shapes"), "h3cute native: install() constants lack 'linear_shapes'");
  for (const auto& shape : constants["linear_shapes"].cast<py::list>()) {
    auto nk = shape.cast<py::tuple>();
    h3.linear_shapes.emplace_back(nk[0].cast<int64_t>(), nk[1].cast<int64_t>());
  }
}

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

// Sets torch's current stream of `device` as tvm-ffi's environment stream (which the compiled kernels
// launch on) for one op's launches, and restores the previous one.
class StreamScope {
 public:
  explicit StreamScope(int device) : device_(device) {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    void* stream = guard.getStream(c10::Device(c10::DeviceType::CUDA, device)).native_handle();
    TVMFFIEnvSetStream(kDLCUDA, device, stream, &previous_);
  }
  ~StreamScope() { TVMFFIEnvSetStream(kDLCUDA, device_, previous_, nullptr); }

 private:
  int device_;
  TVMFFIStreamHandle previous_ = nullptr;
};

// A DLTensor over a tensor's memory with its own shape and strides (elements) from element `offset` (the views
// the kernels are compiled for that torch does not hold: transposed operands, column blocks, ...). `any()` points
// the DLTensor at this object's arrays, so a View may be copied.
class View {
 public:
  View(const at::Tensor& base, c10::IntArrayRef dims, c10::IntArrayRef steps, int64_t offset)
      : tensor_(dl_view(base)) {
    TORCH_CHECK(dims.size() == steps.size() && dims.size() <= 3, "h3cute native: bad view");
    std::copy(dims.begin(), dims.end(), shape_);
    std::copy(steps.begin(), steps.end(), strides_);
    tensor_.ndim = static_cast<int32_t>(dims.size());
    tensor_.data = static_cast<char*>(base.data_ptr()) + offset * base.element_size();
  }
  TVMFFIAny any() const {
    tensor_.shape = shape_, tensor_.strides = strides_;
    TVMFFIAny a;
    a.type_index = kTVMFFIDLTensorPtr;
    a.zero_padding = 0;
    a.v_ptr = &tensor_;
    return a;
  }

 private:
  mutable DLTensor tensor_;
  mutable int64_t shape_[3], strides_[3];
};

// One kernel argument: a View (as a DLTensor), an FP32 scalar such as eps, or an Int64 one such as a check slot's
// address. The walk keeps a call's arguments alive through the call, so the DLTensor pointers stay valid.
class KernelArg {
 public:
  KernelArg(View v) : view_(std::move(v)) {}    // NOLINT
  KernelArg(double v) : scalar_(v) {}           // NOLINT
  KernelArg(int64_t v) : int_(v), is_int_(true) {}  // NOLINT
  TVMFFIAny any() const {
    if (view_) return view_->any();
    TVMFFIAny a;
    a.zero_padding = 0;
    if (is_int_) {
      a.type_index = kTVMFFIInt;
      a.v_int64 = int_;
    } else {
      a.type_index = kTVMFFIFloat;
      a.v_float64 = scalar_;
    }
    return a;
  }

 private:
  std::optional<View> view_;
  double scalar_ = 0.0;
  int64_t int_ = 0;
  bool is_int_ = false;
};

// Calls one compiled kernel; a kernel-side error (its argument checks) becomes a RuntimeError.
constexpr size_t kMaxArgs = 12;
void call_kernel(TVMFFIObjectHandle fn, const KernelArg* args, size_t count) {
  TORCH_CHECK(count <= kMaxArgs, "h3cute native: too many kernel arguments");
  TVMFFIAny anys[kMaxArgs];
  size_t n = 0;
  for (; n < count; ++n) anys[n] = args[n].any();
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  if (TVMFFIFunctionCall(fn, anys, static_cast<int32_t>(n), &result) == 0) return;
  TVMFFIObjectHandle err = nullptr;
  TVMFFIErrorMoveFromRaised(&err);
  std::string msg = "h3cute kernel call failed";
  if (err != nullptr) {
    TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
    msg = std::string(cell->kind.data, cell->kind.size) + ": " + std::string(cell->message.data, cell->message.size);
    TVMFFIObjectDecRef(err);
  }
  TORCH_CHECK(false, msg);
}

// Calls `<module>.<fn>(*args)`, the op's Python CUDA impl, for every input off the C++ fast path (and for
// every call while a check slot is pending: h3cute.launch.checks.raise_pending raises it first).
template <typename R, typename... Args>
R python_impl(const char* module, const char* fn, const Args&... args) {
  py::gil_scoped_acquire gil;
  py::module_::import("h3cute.launch.checks").attr("raise_pending")();
  return py::module_::import(module).attr(fn)(args...).template cast<R>();
}

// The host-mapped words of each device's check slots (h3cute/launch/checks.py): slot s of a device has recorded
// a bad input when words[2 s] != 0. Fetched from Python once per device, then read without any CUDA call.
struct CheckWords {
  std::atomic<const volatile int64_t*> words{nullptr};
  std::atomic<int64_t> count{0};
};
CheckWords check_words[kMaxDevices];

// True when a kernel on `device` recorded a bad input that no h3 call has raised yet: the fast paths then hand
// the call to Python, which raises it.
bool errors_pending(int device) {
  if (device < 0 || device >= kMaxDevices) return false;
  CheckWords& c = check_words[device];
  const volatile int64_t* words = c.words.load(std::memory_order_acquire);
  if (words == nullptr) {
    py::gil_scoped_acquire gil;
    auto answer = py::module_::import("h3cute.launch.checks").attr("host_words")(device).cast<py::tuple>();
    c.count.store(answer[1].cast<int64_t>(), std::memory_order_relaxed);
    words = reinterpret_cast<const volatile int64_t*>(answer[0].cast<uintptr_t>());
    c.words.store(words, std::memory_order_release);
  }
  const int64_t count = c.count.load(std::memory_order_relaxed);
  for (int64_t s = 0; s < count; ++s)
    if (words[2 * s] != 0) return true;
  return false;
}

// The CUDA device of an input, -1 for any other (or for None: an undefined tensor, which the Python impl refuses
// naming the argument).
int cuda_device(const at::Tensor& t) { return t.defined() && t.is_cuda() ? t.get_device() : -1; }

// Fast-path predicate: defined, dtype, device, exact sizes (-1: any), dense row-major layout.
bool dense(const at::Tensor& t, at::ScalarType dtype, int device, std::initializer_list<int64_t> sizes) {
  if (!t.defined() || t.scalar_type() != dtype || !t.is_cuda() || t.get_device() != device ||
      t.dim() != static_cast<int64_t>(sizes.size()))
    return false;
  int d = 0;
  for (int64_t want : sizes) {
    if (want >= 0 && t.size(d) != want) return false;
    ++d;
  }
  return t.is_contiguous();
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// ---- launch plans (h3cute/launch/plan.py) --------------------------------------------------------------------
// An op's launch sequence as data: the buffers to allocate, the steps (a kernel launch with its arguments, or a
// fill) in order, and how the outputs are made, for one (op, phase, static key, row range). Python writes each
// plan once (`<module>.native_plan`), this file decodes it once into a `Plan` when a PlanTable fetches it, and
// `walk` runs it with the semantics of plan.py's `walk`: an op on plans holds only its fast-path predicate here.

// plan.Layout
enum class Layout : int64_t { as_is = 0, t = 1, flat = 2, matrix = 3, first = 4, item0 = 5, strided = 6 };
constexpr int64_t kLayouts = 7;

// per_row * M + whole * (M / step * step) + konst, for the op's row count M; with `up`, M's steps rounded up
// ((M + step - 1) / step); with `count`, the whole term counts the steps: whole * (M / step) (plan.Dim)
struct Dim {
  int64_t konst = 0, per_row = 0, whole = 0, step = 1;
  bool up = false, count = false;
  int64_t at(int64_t m) const {
    const int64_t steps = (up ? m + step - 1 : m) / step;
    return per_row * m + whole * (count ? steps : steps * step) + konst;
  }
};

// a step's guard: none, or dim(M) != 0 (nonzero) / == 0 (plan.Cond)
struct Cond {
  bool has = false, nonzero = true;
  Dim dim;
  bool holds(int64_t m) const { return !has || ((dim.at(m) != 0) == nonzero); }
};

// a kernel argument: an Int64 scalar, a float input `source` passed by value (`is_scalar`, plan.Scalar), or a view
// of source `source` (the inputs, then the buffers): rows [start, stop) of dim 0 when `ranged`, then `layout`, with
// Layout::strided the geometry (sizes, strides, offset) (plan.View, plan.Strided)
struct Arg {
  bool is_int = false, is_scalar = false;
  int64_t value = 0;
  int64_t source = 0;
  bool ranged = false;
  Dim start, stop;
  Layout layout = Layout::as_is;
  std::vector<Dim> sizes, strides;
  Dim offset;
};

enum class StepKind : int64_t { launch = 0, fill = 1 };
struct Step {
  StepKind kind = StepKind::launch;
  int64_t kernel = -1;  // an index into Plan::fns (launch)
  double value = 0.0;   // fill
  Cond when;
  std::vector<Arg> args;  // launch: the kernel's arguments; fill: its target
};

struct Buffer {
  at::ScalarType dtype;
  std::vector<Dim> shape;
  int64_t arena = -1;  // carved from arena `arena`'s one allocation (plan.Buffer.arena), -1: its own
};

enum class OutputKind : int64_t { view = 0, column_sum = 1 };
struct Output {
  OutputKind kind = OutputKind::view;
  bool lead = false;  // viewed as the row input's leading dims and its own last dim
  Arg arg;
};

struct Plan {
  int64_t lo = 0, hi = 0, inputs = 0, arenas = 0;
  std::vector<TVMFFIObjectHandle> fns;
  std::vector<Buffer> buffers;
  std::vector<Step> steps;
  std::vector<Output> outputs;
};

// ---- decoding (plan.py `encode`'s wire format) and its mirror, for describe_plan ----

at::ScalarType plan_dtype(int64_t code) {  // plan.DTYPE_CODES
  switch (code) {
    case 0: return at::kFloat;
    case 1: return at::kBFloat16;
    case 2: return at::kLong;
    default: TORCH_CHECK(false, "h3cute native: plan dtype code ", code);
  }
}
int64_t plan_dtype_code(at::ScalarType t) {
  return t == at::kFloat ? 0 : t == at::kBFloat16 ? 1 : 2;
}

Dim decode_dim(const py::handle& h) {
  auto t = h.cast<py::tuple>();
  TORCH_CHECK(t.size() == 4 || t.size() == 6, "h3cute native: a plan dim has 4 terms (and 2 flags)");
  Dim d{t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
        t.size() == 6 && t[4].cast<int64_t>() != 0, t.size() == 6 && t[5].cast<int64_t>() != 0};
  TORCH_CHECK(d.step > 0, "h3cute native: a plan dim's row step must be positive");
  return d;
}
py::tuple encode_dim(const Dim& d) {
  return py::make_tuple(d.konst, d.per_row, d.whole, d.step, static_cast<int64_t>(d.up),
                        static_cast<int64_t>(d.count));
}

Cond decode_cond(const py::handle& h) {
  auto t = h.cast<py::tuple>();
  TORCH_CHECK(t.size() == 3, "h3cute native: a plan cond has 3 fields");
  return Cond{t[0].cast<int64_t>() != 0, t[1].cast<int64_t>() != 0, decode_dim(t[2])};
}
py::tuple encode_cond(const Cond& c) {
  return py::make_tuple(static_cast<int64_t>(c.has), static_cast<int64_t>(c.nonzero), encode_dim(c.dim));
}

Arg decode_arg(const py::handle& h, int64_t sources, int64_t inputs) {
  auto t = h.cast<py::tuple>();
  Arg a;
  TORCH_CHECK(t.size() >= 2, "h3cute native: bad plan argument");
  if (t[0].cast<int64_t>() == 0) {
    TORCH_CHECK(t.size() == 2, "h3cute native: bad plan int argument");
    a.is_int = true;
    a.value = t[1].cast<int64_t>();
    return a;
  }
  if (t[0].cast<int64_t>() == 2) {
    TORCH_CHECK(t.size() == 2, "h3cute native: bad plan scalar argument");
    a.is_scalar = true;
    a.source = t[1].cast<int64_t>();
    TORCH_CHECK(0 <= a.source && a.source < inputs, "h3cute native: plan scalar input ", a.source);
    return a;
  }
  TORCH_CHECK(t[0].cast<int64_t>() == 1 && (t.size() == 6 || t.size() == 7), "h3cute native: bad plan view argument");
  a.source = t[1].cast<int64_t>();
  a.ranged = t[2].cast<int64_t>() != 0;
  a.start = decode_dim(t[3]);
  a.stop = decode_dim(t[4]);
  const int64_t layout = t[5].cast<int64_t>();
  TORCH_CHECK(0 <= a.source && a.source < sources, "h3cute native: plan argument source ", a.source);
  TORCH_CHECK(0 <= layout && layout < kLayouts, "h3cute native: plan layout code ", layout);
  a.layout = static_cast<Layout>(layout);
  TORCH_CHECK((a.layout == Layout::strided) == (t.size() == 7), "h3cute native: a strided plan view has a geometry");
  if (a.layout == Layout::strided) {
    auto g = t[6].cast<py::tuple>();
    TORCH_CHECK(g.size() == 3, "h3cute native: a plan view geometry has 3 fields");
    for (const auto& d : g[0].cast<py::tuple>()) a.sizes.push_back(decode_dim(d));
    for (const auto& d : g[1].cast<py::tuple>()) a.strides.push_back(decode_dim(d));
    a.offset = decode_dim(g[2]);
    TORCH_CHECK(a.sizes.size() == a.strides.size() && a.sizes.size() <= 3, "h3cute native: bad plan view geometry");
  }
  return a;
}
py::tuple encode_arg(const Arg& a) {
  if (a.is_int) return py::make_tuple(0, a.value);
  if (a.is_scalar) return py::make_tuple(2, a.source);
  auto view = py::make_tuple(1, a.source, static_cast<int64_t>(a.ranged), encode_dim(a.start), encode_dim(a.stop),
                             static_cast<int64_t>(a.layout));
  if (a.layout != Layout::strided) return view;
  py::list sizes, strides;
  for (const Dim& d : a.sizes) sizes.append(encode_dim(d));
  for (const Dim& d : a.strides) strides.append(encode_dim(d));
  return py::make_tuple(1, a.source, static_cast<int64_t>(a.ranged), encode_dim(a.start), encode_dim(a.stop),
                        static_cast<int64_t>(a.layout),
                        py::make_tuple(py::tuple(sizes), py::tuple(strides), encode_dim(a.offset)));
}

Plan decode_plan(const py::tuple& t) {
  TORCH_CHECK(t.size() == 7, "h3cute native: an encoded plan has 7 fields, got ", t.size());
  Plan p;
  p.lo = t[0].cast<int64_t>();
  p.hi = t[1].cast<int64_t>();
  p.inputs = t[2].cast<int64_t>();
  for (const auto& h : t[3].cast<py::tuple>()) p.fns.push_back(reinterpret_cast<void*>(h.cast<uintptr_t>()));
  std::vector<at::ScalarType> arena_dtypes;
  for (const auto& h : t[4].cast<py::tuple>()) {
    auto b = h.cast<py::tuple>();
    TORCH_CHECK(b.size() == 2 || b.size() == 3, "h3cute native: a plan buffer has 2 or 3 fields");
    Buffer buffer{plan_dtype(b[0].cast<int64_t>()), {}, b.size() == 3 ? b[2].cast<int64_t>() : -1};
    for (const auto& d : b[1].cast<py::tuple>()) buffer.shape.push_back(decode_dim(d));
    TORCH_CHECK(buffer.shape.size() <= 3, "h3cute native: a plan buffer has at most 3 dims");
    // arenas are numbered in order of first use, each of one dtype
    TORCH_CHECK(-1 <= buffer.arena && buffer.arena <= p.arenas, "h3cute native: plan buffer arena ", buffer.arena);
    if (buffer.arena == p.arenas) {
      ++p.arenas;
      arena_dtypes.push_back(buffer.dtype);
    }
    TORCH_CHECK(buffer.arena < 0 || arena_dtypes[buffer.arena] == buffer.dtype,
                "h3cute native: a plan arena mixes dtypes");
    p.buffers.push_back(std::move(buffer));
  }
  const int64_t sources = p.inputs + static_cast<int64_t>(p.buffers.size());
  for (const auto& h : t[5].cast<py::tuple>()) {
    auto s = h.cast<py::tuple>();
    TORCH_CHECK(s.size() == 5, "h3cute native: a plan step has 5 fields");
    Step step;
    const int64_t kind = s[0].cast<int64_t>();
    TORCH_CHECK(kind == 0 || kind == 1, "h3cute native: plan step kind ", kind);
    step.kind = static_cast<StepKind>(kind);
    step.kernel = s[1].cast<int64_t>();
    step.value = s[2].cast<double>();
    step.when = decode_cond(s[3]);
    for (const auto& a : s[4].cast<py::tuple>()) step.args.push_back(decode_arg(a, sources, p.inputs));
    if (step.kind == StepKind::launch) {
      TORCH_CHECK(0 <= step.kernel && step.kernel < static_cast<int64_t>(p.fns.size()) &&
                      step.args.size() <= kMaxArgs, "h3cute native: bad plan launch");
    } else {
      TORCH_CHECK(step.args.size() == 1 && !step.args[0].is_int && !step.args[0].is_scalar,
                  "h3cute native: a plan fill has one view");
    }
    p.steps.push_back(std::move(step));
  }
  for (const auto& h : t[6].cast<py::tuple>()) {
    auto o = h.cast<py::tuple>();
    TORCH_CHECK(o.size() == 3, "h3cute native: a plan output has 3 fields");
    const int64_t kind = o[0].cast<int64_t>();
    TORCH_CHECK(kind == 0 || kind == 1, "h3cute native: plan output kind ", kind);
    Output out{static_cast<OutputKind>(kind), o[1].cast<int64_t>() != 0, decode_arg(o[2], sources, p.inputs)};
    TORCH_CHECK(!out.arg.is_int && !out.arg.is_scalar, "h3cute native: a plan output is a view");
    p.outputs.push_back(out);
  }
  return p;
}

py::tuple encode_plan(const Plan& p) {
  py::list fns, buffers, steps, outputs;
  for (TVMFFIObjectHandle fn : p.fns) fns.append(reinterpret_cast<uintptr_t>(fn));
  for (const Buffer& b : p.buffers) {
    py::list shape;
    for (const Dim& d : b.shape) shape.append(encode_dim(d));
    buffers.append(py::make_tuple(plan_dtype_code(b.dtype), py::tuple(shape), b.arena));
  }
  for (const Step& s : p.steps) {
    py::list args;
    for (const Arg& a : s.args) args.append(encode_arg(a));
    steps.append(py::make_tuple(static_cast<int64_t>(s.kind), s.kernel, s.value, encode_cond(s.when), py::tuple(args)));
  }
  for (const Output& o : p.outputs)
    outputs.append(py::make_tuple(static_cast<int64_t>(o.kind), static_cast<int64_t>(o.lead), encode_arg(o.arg)));
  return py::make_tuple(p.lo, p.hi, p.inputs, py::tuple(fns), py::tuple(buffers), py::tuple(steps),
                        py::tuple(outputs));
}

// ---- the walker ----

// A kernel's view of a source's memory: base, element offset from base's data pointer, sizes and strides.
struct Operand {
  at::Tensor base;
  int64_t source = -1;  // which input or buffer (-1: a tensor the walk made, a column sum)
  int64_t offset = 0;
  int64_t ndim = 0;
  int64_t sizes[3] = {0, 0, 0}, strides[3] = {0, 0, 0};
  std::optional<double> scalar;  // a float input (plan.Scalar's), no tensor

  Operand(double v) : scalar(v) {}  // NOLINT: implicit, a float input such as eps

  Operand(const at::Tensor& t) : base(t), ndim(t.dim()) {  // NOLINT: implicit, an input as it is
    TORCH_CHECK(ndim <= 3, "h3cute native: a plan operand has at most 3 dims");
    for (int64_t d = 0; d < ndim; ++d) sizes[d] = t.size(d), strides[d] = t.stride(d);
  }
  Operand(const at::Tensor& t, int64_t dims) : base(t), ndim(dims) {}  // geometry set by the caller
  // a dense (..., width) tensor as its (rows, width) rows
  static Operand rows(const at::Tensor& t, int64_t width) {
    Operand o(t, 2);
    o.sizes[0] = t.numel() / width, o.sizes[1] = width, o.strides[0] = width, o.strides[1] = 1;
    return o;
  }
  // columns [start, start + width) of a 2-D tensor, its row stride kept (e.g. a half of final_adaln_out's table)
  static Operand columns(const at::Tensor& t, int64_t start, int64_t width) {
    Operand o(t);
    o.offset = start * o.strides[1], o.sizes[1] = width;
    return o;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d = 0; d < ndim; ++d) n *= sizes[d];
    return n;
  }
  bool dense() const {
    int64_t step = 1;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      if (sizes[d] != 1 && strides[d] != step) return false;
      step *= sizes[d];
    }
    return true;
  }
  c10::IntArrayRef shape() const { return {sizes, static_cast<size_t>(ndim)}; }
  c10::IntArrayRef steps() const { return {strides, static_cast<size_t>(ndim)}; }
  View view() const { return View(base, shape(), steps(), offset); }
  // the tensor itself where the view is all of it, else an as_strided view
  at::Tensor tensor() const {
    if (offset == 0 && base.sizes() == shape() && base.strides() == steps()) return base;
    return base.as_strided(shape(), steps(), base.storage_offset() + offset);
  }
};

Operand resolve(const Arg& a, const std::vector<Operand>& env, int64_t m) {
  Operand o = env[a.source];
  TORCH_CHECK(!o.scalar, "h3cute native: a plan view of a float input");
  if (a.ranged) {
    const int64_t start = a.start.at(m), stop = a.stop.at(m);
    TORCH_CHECK(o.ndim >= 1 && 0 <= start && start <= stop && stop <= o.sizes[0], "h3cute native: plan rows [",
                start, ", ", stop, ") of ", o.ndim >= 1 ? o.sizes[0] : 0);
    o.offset += start * o.strides[0];
    o.sizes[0] = stop - start;
  }
  switch (a.layout) {
    case Layout::as_is: break;
    case Layout::t: {  // plan.py: as_strided((C, R), (1, C)) of an (R, C)
      TORCH_CHECK(o.ndim == 2, "h3cute native: a transposed plan operand is 2-D");
      const int64_t r = o.sizes[0], c = o.sizes[1];
      o.sizes[0] = c, o.sizes[1] = r, o.strides[0] = 1, o.strides[1] = c;
      break;
    }
    case Layout::flat:
    case Layout::matrix:
    case Layout::first: {
      TORCH_CHECK(o.dense(), "h3cute native: a flattened plan operand is dense");
      const int64_t n = o.numel(), d0 = o.ndim ? o.sizes[0] : 1;
      if (a.layout == Layout::matrix) {
        TORCH_CHECK(o.ndim >= 1 && d0 > 0, "h3cute native: an empty plan matrix");
        o.ndim = 2, o.sizes[0] = d0, o.sizes[1] = n / d0, o.strides[0] = n / d0, o.strides[1] = 1;
      } else {
        o.ndim = 1, o.sizes[0] = a.layout == Layout::first ? 1 : n, o.strides[0] = 1;
      }
      break;
    }
    case Layout::item0:
      TORCH_CHECK(o.ndim >= 2 && o.sizes[0] >= 1, "h3cute native: a plan item of an empty or 1-D operand");
      for (int64_t d = 1; d < o.ndim; ++d) o.sizes[d - 1] = o.sizes[d], o.strides[d - 1] = o.strides[d];
      --o.ndim;
      break;
    case Layout::strided: {  // plan.py: as_strided(sizes, strides, the source's offset + the view's offset)
      int64_t last = o.offset + a.offset.at(m), numel = 1;  // the last element's index, from base's data pointer
      o.offset = last;
      o.ndim = static_cast<int64_t>(a.sizes.size());
      for (int64_t d = 0; d < o.ndim; ++d) {
        o.sizes[d] = a.sizes[d].at(m), o.strides[d] = a.strides[d].at(m);
        numel *= o.sizes[d];
        last += (o.sizes[d] - 1) * o.strides[d];
      }
      const int64_t room = static_cast<int64_t>(o.base.storage().nbytes()) / o.base.element_size() -
                           o.base.storage_offset();  // elements of base's storage from its data pointer
      TORCH_CHECK(numel == 0 || (o.offset >= 0 && last < room), "h3cute native: a strided plan view past its source");
      break;
    }
  }
  return o;
}

// A resolved launch argument: an Int64 scalar, or an Operand (a view, or a float input's `scalar`).
struct Resolved {
  bool is_int;
  int64_t value;
  std::optional<Operand> operand;
};

// Runs `p` on `inputs` for m rows (`lead`: the row input's leading dims): allocates its buffers with `options`'
// device (each on its own, or carved from its arena's one allocation as plan.py's `carve` lays it out: declaration
// order, each region's start rounded up to 16 bytes), then each step whose guard holds in order,
// `launch(kernel index, arguments)` for a launch; returns its outputs. The caller holds the op's StreamScope.
template <typename LaunchFn>
std::vector<at::Tensor> walk(const Plan& p, std::vector<Operand> env, int64_t m, c10::IntArrayRef lead,
                             const at::TensorOptions& options, LaunchFn&& launch) {
  TORCH_CHECK(static_cast<int64_t>(env.size()) == p.inputs, "h3cute native: a plan of ", p.inputs,
              " inputs given ", env.size());
  for (int64_t i = 0; i < p.inputs; ++i) env[i].source = i;
  std::vector<int64_t> totals(p.arenas, 0), starts(p.buffers.size(), 0);
  for (size_t i = 0; i < p.buffers.size(); ++i) {
    const Buffer& b = p.buffers[i];
    if (b.arena < 0) continue;
    const int64_t align = 16 / static_cast<int64_t>(c10::elementSize(b.dtype));
    int64_t numel = 1;
    for (const Dim& d : b.shape) numel *= d.at(m);
    starts[i] = (totals[b.arena] + align - 1) / align * align;
    totals[b.arena] = starts[i] + numel;
  }
  std::vector<at::Tensor> arenas(p.arenas);
  for (size_t i = 0; i < p.buffers.size(); ++i) {
    const Buffer& b = p.buffers[i];
    const int64_t ndim = static_cast<int64_t>(b.shape.size());
    int64_t sizes[3];
    for (int64_t d = 0; d < ndim; ++d) sizes[d] = b.shape[d].at(m);
    if (b.arena < 0) {
      env.emplace_back(at::empty(c10::IntArrayRef(sizes, ndim), options.dtype(b.dtype)));
    } else {
      at::Tensor& arena = arenas[b.arena];
      if (!arena.defined()) arena = at::empty({totals[b.arena]}, options.dtype(b.dtype));
      Operand region(arena, ndim);  // dense row-major at its start
      region.offset = starts[i];
      for (int64_t d = ndim - 1, step = 1; d >= 0; step *= std::max<int64_t>(sizes[d], 1), --d)
        region.sizes[d] = sizes[d], region.strides[d] = step;
      env.push_back(region);
    }
    env.back().source = static_cast<int64_t>(env.size()) - 1;
  }
  std::vector<Resolved> args;
  for (const Step& s : p.steps) {
    if (!s.when.holds(m)) continue;
    if (s.kind == StepKind::fill) {
      resolve(s.args[0], env, m).tensor().fill_(s.value);
      continue;
    }
    args.clear();
    for (const Arg& a : s.args) {
      if (a.is_int)
        args.push_back(Resolved{true, a.value, std::nullopt});
      else if (a.is_scalar)
        args.push_back(Resolved{false, 0, env[a.source]});
      else
        args.push_back(Resolved{false, 0, resolve(a, env, m)});
    }
    launch(s.kernel, args);
  }
  std::vector<at::Tensor> outputs;
  for (const Output& o : p.outputs) {
    at::Tensor t = resolve(o.arg, env, m).tensor();
    if (o.kind == OutputKind::column_sum) t = at::sum(t, 0);
    if (o.lead) {
      std::vector<int64_t> shape(lead.begin(), lead.end());
      shape.push_back(t.size(-1));
      t = t.view(shape);
    }
    outputs.push_back(t);
  }
  return outputs;
}

// walk with the plan's compiled kernels.
std::vector<at::Tensor> walk(const Plan& p, std::vector<Operand> inputs, int64_t m, c10::IntArrayRef lead,
                             const at::TensorOptions& options) {
  return walk(p, std::move(inputs), m, lead, options, [&p](int64_t kernel, const std::vector<Resolved>& args) {
    std::vector<KernelArg> kargs;
    kargs.reserve(args.size());
    for (const Resolved& a : args) {
      if (a.is_int)
        kargs.emplace_back(a.value);
      else if (a.operand->scalar)
        kargs.emplace_back(*a.operand->scalar);
      else
        kargs.emplace_back(a.operand->view());
    }
    call_kernel(p.fns[kernel], kargs.data(), kargs.size());
  });
}

enum class Phase { forward, backward };  // plan.Phase
const char* phase_name(Phase phase) { return phase == Phase::forward ? "forward" : "backward"; }

// The plans of one op, per (device, phase, key, row range), fetched once from `<module>.native_plan(device, phase,
// key, rows)` and decoded into a Plan (kept for the process, like the kernels the Python runtime keeps alive).
// Entries are appended under the GIL and published by the count (readers take no lock).
class PlanTable {
 public:
  static constexpr int kMaxEntries = 64, kMaxKey = 4;

  explicit PlanTable(const char* module) : module_(module) {}

  const Plan& get(int device, Phase phase, std::initializer_list<int64_t> key, int64_t rows) {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "h3cute native: CUDA device index ", device);
    TORCH_CHECK(key.size() <= kMaxKey, "h3cute native: a plan key has at most ", kMaxKey, " fields");
    if (const Plan* p = find(device, phase, key, rows)) return *p;
    py::gil_scoped_acquire gil;  // the lookup may load or compile (and release the GIL meanwhile)
    py::tuple py_key(key.size());
    size_t i = 0;
    for (int64_t k : key) py_key[i++] = py::int_(k);
    auto answer = py::module_::import(module_).attr("native_plan")(device, phase_name(phase), py_key, rows);
    if (const Plan* p = find(device, phase, key, rows)) return *p;  // a racing thread fetched it first
    const int n = count_[device].load(std::memory_order_acquire);
    TORCH_CHECK(n < kMaxEntries, "h3cute native: plan table of ", module_, " is full");
    auto* plan = new Plan(decode_plan(answer.cast<py::tuple>()));
    TORCH_CHECK(plan->lo <= rows && rows <= plan->hi, module_, ".native_plan: a plan for [", plan->lo, ", ",
                plan->hi, "] does not serve ", rows, " rows");
    Entry& e = entries_[device][n];
    e.phase = phase;
    e.nkey = static_cast<int>(key.size());
    std::copy(key.begin(), key.end(), e.key);
    e.plan = plan;
    count_[device].store(n + 1, std::memory_order_release);
    return *plan;
  }

 private:
  struct Entry {
    Phase phase;
    int nkey;
    int64_t key[kMaxKey];
    const Plan* plan;
  };
  const Plan* find(int device, Phase phase, std::initializer_list<int64_t> key, int64_t rows) const {
    const int n = count_[device].load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
      const Entry& e = entries_[device][i];
      if (e.phase == phase && e.nkey == static_cast<int>(key.size()) && std::equal(key.begin(), key.end(), e.key) &&
          e.plan->lo <= rows && rows <= e.plan->hi)
        return e.plan;
    }
    return nullptr;
  }

  const char* module_;
  Entry entries_[kMaxDevices][kMaxEntries] = {};
  std::atomic<int> count_[kMaxDevices] = {};
};

// ---- debug entry points for the CPU tests: what this file decoded, and what it would launch ----

// The plan decoded and encoded again (plan.py `encode`'s format).
py::tuple describe_plan(const py::tuple& encoded) { return encode_plan(decode_plan(encoded)); }

py::tuple describe_operand(const Operand& o) {
  return py::make_tuple(o.source, o.offset, py::tuple(py::cast(std::vector<int64_t>(o.shape().begin(), o.shape().end()))),
                        py::tuple(py::cast(std::vector<int64_t>(o.steps().begin(), o.steps().end()))));
}

// The walk of the decoded plan for `rows` rows on meta tensors of the given (sizes, strides, dtype code) inputs (a
// float: a float input), launching nothing: ([(kernel index, [(0, int) | (1, (source, offset, sizes, strides)) |
// (2, float)])], [(sizes, strides) per output]).
py::tuple describe_walk(const py::tuple& encoded, int64_t rows, const py::list& inputs, std::vector<int64_t> lead) {
  const Plan p = decode_plan(encoded);
  const auto meta = at::TensorOptions().device(at::kMeta);
  std::vector<Operand> env;
  for (const auto& h : inputs) {
    if (py::isinstance<py::float_>(h)) {
      env.emplace_back(h.cast<double>());
      continue;
    }
    auto geometry = h.cast<py::tuple>();
    env.emplace_back(at::empty_strided(geometry[0].cast<std::vector<int64_t>>(),
                                       geometry[1].cast<std::vector<int64_t>>(),
                                       meta.dtype(plan_dtype(geometry[2].cast<int64_t>()))));
  }
  py::list launches, outputs;
  auto record = [&launches](int64_t kernel, const std::vector<Resolved>& args) {
    py::list described;
    for (const Resolved& a : args)
      described.append(a.is_int             ? py::tuple(py::make_tuple(0, a.value))
                       : a.operand->scalar ? py::tuple(py::make_tuple(2, *a.operand->scalar))
                                            : py::tuple(py::make_tuple(1, describe_operand(*a.operand))));
    launches.append(py::make_tuple(kernel, py::tuple(described)));
  };
  for (const at::Tensor& t : walk(p, std::move(env), rows, lead, meta, record))
    outputs.append(py::make_tuple(py::tuple(py::cast(t.sizes().vec())), py::tuple(py::cast(t.strides().vec()))));
  return py::make_tuple(py::tuple(launches), py::tuple(outputs));
}

// ---- timestep_sinusoid (launch plans: h3cute/launch/timestep_sinusoid.py) -----------------------------------

PlanTable sinusoid_plans("h3cute.launch.timestep_sinusoid");  // key (check_range)

at::Tensor timestep_sinusoid_cuda(const at::Tensor& t, bool check_range) {
  // Fast path: 1-D contiguous FP32, no gradient asked for. Anything else (widening, errors with their
  // messages, the no-gradient refusal) is the Python impl's.
  const bool fast = t.defined() && t.dim() == 1 && t.scalar_type() == at::kFloat && (t.size(0) <= 1 || t.stride(0) == 1) &&
                    !(t.requires_grad() && at::GradMode::is_enabled()) && t.is_cuda() && !errors_pending(t.get_device());
  if (!fast) return python_impl<at::Tensor>("h3cute.ops.timestep", "_sinusoid_cuda", t, check_range);
  const int device = t.get_device();
  const Plan& plan = sinusoid_plans.get(device, Phase::forward, {check_range}, t.size(0));
  StreamScope stream(device);
  return walk(plan, {t}, t.size(0), t.sizes(), t.options())[0];
}

// ---- timestep_mlp (h3cute/launch/timestep_mlp.py: its launch plans, the default picks) -------------------

PlanTable mlp_plans("h3cute.launch.timestep_mlp");

bool mlp_fast(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2, int d) {
  return dense(x, at::kFloat, d, {-1, h3.freq}) && x.size(0) > 0 &&
         dense(w1, at::kFloat, d, {h3.mlp_hidden, h3.freq}) && dense(b1, at::kFloat, d, {h3.mlp_hidden}) &&
         dense(w2, at::kFloat, d, {h3.temb, h3.mlp_hidden});
}

at::Tensor timestep_mlp_cuda(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                             const at::Tensor& b2) {
  const int d = cuda_device(x);
  if (!(mlp_fast(x, w1, b1, w2, d) && dense(b2, at::kFloat, d, {h3.temb}) && !errors_pending(d)))
    return python_impl<at::Tensor>("h3cute.ops.timestep", "_mlp_cuda", x, w1, b1, w2, b2);
  const int64_t rows = x.size(0);
  const Plan& plan = mlp_plans.get(d, Phase::forward, {}, rows);
  StreamScope stream(d);
  return walk(plan, {x, w1, b1, w2, b2}, rows, x.sizes().slice(0, 1), x.options())[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> timestep_mlp_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2) {
  const int d = cuda_device(x);
  if (!(mlp_fast(x, w1, b1, w2, d) && dense(grad, at::kFloat, d, {x.size(0), h3.temb}) && !errors_pending(d))) {
    using R = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
    return python_impl<R>("h3cute.ops.timestep", "_mlp_backward_cuda", grad, x, w1, b1, w2);
  }
  const int64_t rows = x.size(0);
  const Plan& plan = mlp_plans.get(d, Phase::backward, {}, rows);
  StreamScope stream(d);
  auto out = walk(plan, {grad, x, w1, b1, w2}, rows, x.sizes().slice(0, 1), x.options());
  return {out[0], out[1], out[2], out[3], out[4]};
}

// ---- norm_modulate and final_adaln_out (launch plans: h3cute/launch/norm_modulate.py, final_adaln_out.py) ------

// norm_modulate: key (width, check_indices) forward, (width, table rows, table_grad 0) backward
PlanTable norm_modulate_plans("h3cute.launch.norm_modulate");
// final_adaln_out: the projection's and the norm rows' plans (final_adaln_out.py part_plan): key (kFinalProjection)
// over M = T; (kFinalRows, check_indices) forward, (kFinalRows, T) backward over M = S
PlanTable final_plans("h3cute.launch.final_adaln_out");
constexpr int64_t kFinalProjection = 0, kFinalRows = 1;  // final_adaln_out.py PROJECTION, ROWS

// x (S, H) and out-shaped row tensors: BF16, dense, 16-byte aligned, S >= 1.
bool rows_fast(const at::Tensor& x, int d) {
  return dense(x, at::kBFloat16, d, {-1, h3.hidden}) && x.size(0) > 0 && aligned16(x);
}

// A (R, H) BF16 table read in place with 16-byte row loads: unit column stride, rows 16-byte aligned.
bool table_fast(const at::Tensor& t, int d, int64_t width = h3.hidden) {
  return t.defined() && t.scalar_type() == at::kBFloat16 && t.is_cuda() && t.get_device() == d && t.dim() == 2 &&
         t.size(0) > 0 && t.size(1) == width && t.stride(1) == 1 && t.stride(0) >= width &&
         t.stride(0) % 8 == 0 && aligned16(t);
}

at::Tensor norm_modulate_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& shift,
                              const at::Tensor& scale, const at::Tensor& idx, double eps, bool check_indices) {
  // check_indices: the kernel checks every index itself and records a bad one in the op's check slot.
  const int d = cuda_device(x);
  const bool fast = eps > 0 && rows_fast(x, d) && dense(weight, at::kBFloat16, d, {h3.hidden}) &&
                    aligned16(weight) && table_fast(shift, d) && table_fast(scale, d) &&
                    shift.size(0) == scale.size(0) && dense(idx, at::kLong, d, {x.size(0)}) && !errors_pending(d);
  if (!fast)
    return python_impl<at::Tensor>("h3cute.ops.adaln", "_norm_modulate_cuda", x, weight, shift, scale, idx, eps,
                                   check_indices);
  const Plan& plan = norm_modulate_plans.get(d, Phase::forward, {h3.hidden, check_indices}, x.size(0));
  StreamScope stream(d);
  return walk(plan, {x, weight, shift, scale, idx, eps}, x.size(0), x.sizes().slice(0, 1), x.options())[0];
}

// (out, table): the output and the (T, 2H) projection shift | scale, which the C++ autograd keeps for the backward.
// The projection's plan over the T timesteps, then the norm rows' over the S rows with the projection's halves as
// their row-strided (T, H) tables, read in place (final_adaln_out.py forward_with_table).
std::tuple<at::Tensor, at::Tensor> final_adaln_out_fwd_cuda(const at::Tensor& x, const at::Tensor& norm_weight,
                                                            const at::Tensor& temb, const at::Tensor& proj_weight,
                                                            const at::Tensor& proj_bias, const at::Tensor& ti,
                                                            double eps, bool check_indices) {
  const int d = cuda_device(x);
  const bool fast = eps > 0 && rows_fast(x, d) && dense(norm_weight, at::kBFloat16, d, {h3.hidden}) &&
                    aligned16(norm_weight) && dense(temb, at::kFloat, d, {-1, h3.temb}) && aligned16(temb) &&
                    temb.size(0) > 0 && dense(proj_weight, at::kBFloat16, d, {h3.final_projection, h3.temb}) &&
                    aligned16(proj_weight) && dense(proj_bias, at::kBFloat16, d, {h3.final_projection}) &&
                    aligned16(proj_bias) && dense(ti, at::kLong, d, {x.size(0)}) && !errors_pending(d);
  if (!fast) {
    using R = std::tuple<at::Tensor, at::Tensor>;
    return python_impl<R>("h3cute.ops.adaln", "_final_fwd_cuda", x, norm_weight, temb, proj_weight, proj_bias, ti,
                          eps, check_indices);
  }
  const int64_t timesteps = temb.size(0), rows = x.size(0);
  const Plan& projection = final_plans.get(d, Phase::forward, {kFinalProjection}, timesteps);
  const Plan& norm = final_plans.get(d, Phase::forward, {kFinalRows, check_indices}, rows);
  StreamScope stream(d);
  at::Tensor proj = walk(projection, {temb, proj_weight, proj_bias}, timesteps, temb.sizes().slice(0, 1),
                         temb.options())[0];
  at::Tensor out = walk(norm, {x, norm_weight, Operand::columns(proj, 0, h3.hidden),
                               Operand::columns(proj, h3.hidden, h3.hidden), ti, eps},
                        rows, x.sizes().slice(0, 1), x.options())[0];
  return {out, proj};
}

at::Tensor final_adaln_out_cuda(const at::Tensor& x, const at::Tensor& norm_weight, const at::Tensor& temb,
                                const at::Tensor& proj_weight, const at::Tensor& proj_bias, const at::Tensor& ti,
                                double eps, bool check_indices) {
  return std::get<0>(final_adaln_out_fwd_cuda(x, norm_weight, temb, proj_weight, proj_bias, ti, eps, check_indices));
}

// ---- norm_modulate and final_adaln_out backward, gate_residual (launch plans: norm_modulate.py, gate_residual.py) -

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_modulate_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
    const at::Tensor& idx, double eps, int64_t table_rows) {
  const int d = cuda_device(x);
  const bool fast = eps > 0 && rows_fast(x, d) && rows_fast(grad, d) && grad.size(0) == x.size(0) &&
                    dense(weight, at::kBFloat16, d, {h3.hidden}) && aligned16(weight) && table_fast(scale, d) &&
                    scale.size(0) == table_rows && table_rows <= h3.max_fused_table_rows &&
                    dense(idx, at::kLong, d, {x.size(0)}) && !errors_pending(d);
  if (!fast) {
    using R = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
    return python_impl<R>("h3cute.ops.adaln", "_norm_modulate_backward_cuda", grad, x, weight, scale, idx, eps,
                          table_rows);
  }
  const Plan& plan = norm_modulate_plans.get(d, Phase::backward, {h3.hidden, table_rows, 0}, x.size(0));
  StreamScope stream(d);
  auto out = walk(plan, {grad, x, weight, scale, idx, eps}, x.size(0), x.sizes().slice(0, 1), x.options());
  return {out[0], out[1], out[2], out[3]};
}

// final_adaln_out's backward for T <= 24 timesteps (final_adaln_out.py backward; the norm rows' backward plans are
// keyed by T, and the plan table holds a bounded number of them): the projection (the forward's `table`, or its plan
// walked again), the norm rows' backward plan on its row-strided scale half, giving the table gradient (T, 2H)
// [dshift | dscale] in the projection's layout, then the projection's backward plan on that gradient.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> final_adaln_out_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& nw, const at::Tensor& temb,
    const at::Tensor& pw, const at::Tensor& pb, const at::Tensor& ti, double eps,
    const std::optional<at::Tensor>& table) {
  const int d = cuda_device(x);
  const bool fast = eps > 0 && rows_fast(x, d) && rows_fast(grad, d) && grad.size(0) == x.size(0) &&
                    dense(nw, at::kBFloat16, d, {h3.hidden}) && aligned16(nw) &&
                    dense(temb, at::kFloat, d, {-1, h3.temb}) && aligned16(temb) && temb.size(0) > 0 &&
                    temb.size(0) <= h3.max_fused_table_rows &&
                    dense(pw, at::kBFloat16, d, {h3.final_projection, h3.temb}) && aligned16(pw) &&
                    dense(pb, at::kBFloat16, d, {h3.final_projection}) && aligned16(pb) &&
                    dense(ti, at::kLong, d, {x.size(0)}) &&
                    (!table || (dense(*table, at::kBFloat16, d, {temb.size(0), h3.final_projection}) &&
                                aligned16(*table))) && !errors_pending(d);
  if (!fast) {
    using R = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
    return python_impl<R>("h3cute.ops.adaln", "_final_backward_cuda", grad, x, nw, temb, pw, pb, ti, eps, table);
  }
  const int64_t timesteps = temb.size(0), rows = x.size(0);
  const Plan* recompute = table ? nullptr : &final_plans.get(d, Phase::forward, {kFinalProjection}, timesteps);
  const Plan& norm = final_plans.get(d, Phase::backward, {kFinalRows, timesteps}, rows);
  const Plan& projection = final_plans.get(d, Phase::backward, {kFinalProjection}, timesteps);
  const c10::IntArrayRef lead = temb.sizes().slice(0, 1);
  StreamScope stream(d);
  at::Tensor proj = table ? *table : walk(*recompute, {temb, pw, pb}, timesteps, lead, temb.options())[0];
  auto g = walk(norm, {grad, x, nw, Operand::columns(proj, h3.hidden, h3.hidden), ti, eps}, rows,
                x.sizes().slice(0, 1), x.options());  // dx, dweight, dtable
  auto p = walk(projection, {g[2], temb, pw}, timesteps, lead, temb.options());  // dtemb, dW, db
  return {g[0], g[1], p[0], p[1], p[2]};
}

// gate_residual (launch plans): key (width, check_indices) forward, (width, table rows) backward
PlanTable gate_residual_plans("h3cute.launch.gate_residual");

at::Tensor gate_residual_cuda(const at::Tensor& residual, const at::Tensor& y, const at::Tensor& gate,
                              const at::Tensor& idx, bool check_indices) {
  const int d = cuda_device(y);
  const bool fast = rows_fast(y, d) && rows_fast(residual, d) && residual.size(0) == y.size(0) &&
                    table_fast(gate, d) && dense(idx, at::kLong, d, {y.size(0)}) && !errors_pending(d);
  if (!fast)
    return python_impl<at::Tensor>("h3cute.ops.adaln", "_gate_residual_cuda", residual, y, gate, idx, check_indices);
  const Plan& plan = gate_residual_plans.get(d, Phase::forward, {h3.hidden, check_indices}, y.size(0));
  StreamScope stream(d);
  return walk(plan, {residual, y, gate, idx}, y.size(0), y.sizes().slice(0, 1), y.options())[0];
}

std::tuple<at::Tensor, at::Tensor> gate_residual_backward_cuda(const at::Tensor& grad, const at::Tensor& y,
                                                               const at::Tensor& gate, const at::Tensor& idx) {
  const int d = cuda_device(y);
  const bool fast = rows_fast(y, d) && rows_fast(grad, d) && grad.size(0) == y.size(0) && table_fast(gate, d) &&
                    gate.size(0) <= h3.max_table_rows && dense(idx, at::kLong, d, {y.size(0)}) && !errors_pending(d);
  if (!fast)
    return python_impl<std::tuple<at::Tensor, at::Tensor>>("h3cute.ops.adaln", "_gate_residual_backward_cuda", grad,
                                                           y, gate, idx);
  const Plan& plan = gate_residual_plans.get(d, Phase::backward, {h3.hidden, gate.size(0)}, y.size(0));
  StreamScope stream(d);
  auto out = walk(plan, {grad, y, gate, idx}, y.size(0), y.sizes().slice(0, 1), y.options());
  return {out[0], out[1]};
}

// ---- gate_residual_norm_modulate (h3cute/launch/gate_residual_norm_modulate.py) ------------------------------

// the forward on launch plans: key (width, check_indices); the backward runs norm_modulate's and gate_residual's
PlanTable gated_norm_plans("h3cute.launch.gate_residual_norm_modulate");

std::tuple<at::Tensor, at::Tensor> gate_residual_norm_modulate_cuda(const at::Tensor& residual, const at::Tensor& y,
                                                                    const at::Tensor& gate, const at::Tensor& weight,
                                                                    const at::Tensor& shift, const at::Tensor& scale,
                                                                    const at::Tensor& idx, double eps,
                                                                    bool check_indices) {
  const int d = cuda_device(y);
  const bool fast = eps > 0 && rows_fast(y, d) && rows_fast(residual, d) && residual.size(0) == y.size(0) &&
                    dense(weight, at::kBFloat16, d, {h3.hidden}) && aligned16(weight) && table_fast(gate, d) &&
                    table_fast(shift, d) && table_fast(scale, d) && gate.size(0) == scale.size(0) &&
                    shift.size(0) == scale.size(0) && dense(idx, at::kLong, d, {y.size(0)}) && !errors_pending(d);
  if (!fast) {
    using R = std::tuple<at::Tensor, at::Tensor>;
    return python_impl<R>("h3cute.ops.adaln", "_fused_cuda", residual, y, gate, weight, shift, scale, idx, eps,
                          check_indices);
  }
  const Plan& plan = gated_norm_plans.get(d, Phase::forward, {h3.hidden, check_indices}, y.size(0));
  StreamScope stream(d);
  auto out = walk(plan, {residual, y, gate, weight, shift, scale, idx, eps}, y.size(0), y.sizes().slice(0, 1),
                  y.options());
  return {out[0], out[1]};
}

// ---- adaln_row_gather (h3cute/launch/adaln_row_gather.py) ---------------------------------------------

// launch plans: key (width, check_indices) forward, (width, table rows) backward
PlanTable row_gather_plans("h3cute.launch.adaln_row_gather");

std::vector<at::Tensor> adaln_row_gather_cuda(const at::Tensor& table, const at::Tensor& idx, bool check_indices) {
  const int d = cuda_device(table);
  const bool fast = table_fast(table, d, h3.block_table) && dense(idx, at::kLong, d, {-1}) && idx.size(0) > 0 &&
                    !errors_pending(d);
  if (!fast)
    return python_impl<std::vector<at::Tensor>>("h3cute.ops.adaln", "_gather_cuda", table, idx, check_indices);
  const int64_t rows = idx.size(0);
  const Plan& plan = row_gather_plans.get(d, Phase::forward, {h3.hidden, check_indices}, rows);
  StreamScope stream(d);
  return walk(plan, {table, idx}, rows, idx.sizes(), table.options());
}

at::Tensor adaln_row_gather_backward_cuda(at::TensorList grads, const at::Tensor& idx, int64_t table_rows) {
  const int d = cuda_device(idx);
  bool fast = static_cast<int64_t>(grads.size()) == h3.block_chunks && dense(idx, at::kLong, d, {-1}) &&
              idx.size(0) > 0 && table_rows > 0 && table_rows <= h3.max_table_rows && !errors_pending(d);
  for (size_t c = 0; fast && c < grads.size(); ++c) fast = rows_fast(grads[c], d) && grads[c].size(0) == idx.size(0);
  if (!fast)
    return python_impl<at::Tensor>("h3cute.ops.adaln", "_gather_backward_cuda",
                                   std::vector<at::Tensor>(grads.begin(), grads.end()), idx, table_rows);
  const Plan& plan = row_gather_plans.get(d, Phase::backward, {h3.hidden, table_rows}, idx.size(0));
  std::vector<Operand> inputs(grads.begin(), grads.end());
  inputs.emplace_back(idx);
  StreamScope stream(d);
  return walk(plan, std::move(inputs), idx.size(0), idx.sizes(), grads[0].options())[0];
}

// ---- adaln_projection (h3cute/launch/adaln_projection.py, N = 96768) ------------------------------------

// adaln_projection (launch plans): key (N,), the default picks
PlanTable projection_plans("h3cute.launch.adaln_projection");

bool projection_fast(const at::Tensor& temb, const at::Tensor& weight, int d) {
  return dense(temb, at::kFloat, d, {-1, h3.temb}) && aligned16(temb) && temb.size(0) > 0 &&
         dense(weight, at::kBFloat16, d, {h3.block_projection, h3.temb}) && aligned16(weight) && !errors_pending(d);
}

at::Tensor adaln_projection_cuda(const at::Tensor& temb, const at::Tensor& weight, const at::Tensor& bias) {
  const int d = cuda_device(temb);
  if (!(projection_fast(temb, weight, d) && dense(bias, at::kBFloat16, d, {h3.block_projection}) && aligned16(bias)))
    return python_impl<at::Tensor>("h3cute.ops.adaln", "_projection_cuda", temb, weight, bias);
  const int64_t timesteps = temb.size(0);
  const Plan& plan = projection_plans.get(d, Phase::forward, {h3.block_projection}, timesteps);
  StreamScope stream(d);
  return walk(plan, {temb, weight, bias}, timesteps, temb.sizes().slice(0, 1), temb.options())[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> adaln_projection_backward_cuda(const at::Tensor& grad,
                                                                              const at::Tensor& temb,
                                                                              const at::Tensor& weight) {
  const int d = cuda_device(temb);
  if (!(projection_fast(temb, weight, d) && dense(grad, at::kBFloat16, d, {temb.size(0), h3.block_projection}) &&
        aligned16(grad)))
    return python_impl<std::tuple<at::Tensor, at::Tensor, at::Tensor>>("h3cute.ops.adaln", "_projection_backward_cuda",
                                                                       grad, temb, weight);
  const int64_t timesteps = temb.size(0);
  const Plan& plan = projection_plans.get(d, Phase::backward, {h3.block_projection}, timesteps);
  StreamScope stream(d);
  auto out = walk(plan, {grad, temb, weight}, timesteps, temb.sizes().slice(0, 1), temb.options());
  return {out[0], out[1], out[2]};
}

// ---- linear (h3cute/launch/linear.py, the FP32 heads: launch plans) --------------------------------------

// key: (N, K, bias) forward, (N, K, x_grad) backward
PlanTable linear_plans("h3cute.launch.linear");

// A dense, aligned FP32 weight of a served shape (h3.linear_shapes) on device d.
bool linear_weight(const at::Tensor& weight, int d) {
  if (!(dense(weight, at::kFloat, d, {-1, -1}) && aligned16(weight))) return false;
  return std::find(h3.linear_shapes.begin(), h3.linear_shapes.end(), std::make_pair(weight.size(0), weight.size(1))) !=
         h3.linear_shapes.end();
}

// x (..., width) as dense, aligned FP32 rows on device d, at least one row.
bool linear_rows(const at::Tensor& x, int64_t width, int d) {
  return x.defined() && x.scalar_type() == at::kFloat && x.is_cuda() && x.get_device() == d && x.dim() >= 1 &&
         x.size(-1) == width && x.numel() > 0 && x.is_contiguous() && aligned16(x);
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int d = cuda_device(x);
  const bool has_bias = bias.has_value() && bias->defined();
  if (!(linear_weight(weight, d) && linear_rows(x, weight.size(1), d) &&
        (!has_bias || (dense(*bias, at::kFloat, d, {weight.size(0)}) && aligned16(*bias))) && !errors_pending(d)))
    return python_impl<at::Tensor>("h3cute.ops.linear", "_linear_cuda", x, weight, bias);
  const int64_t n = weight.size(0), k = weight.size(1), rows = x.numel() / k;
  const Plan& plan = linear_plans.get(d, Phase::forward, {n, k, has_bias}, rows);
  std::vector<Operand> inputs{Operand::rows(x, k), weight};
  if (has_bias) inputs.emplace_back(*bias);
  StreamScope stream(d);
  return walk(plan, std::move(inputs), rows, x.sizes().slice(0, x.dim() - 1), x.options())[0];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_cuda(const at::Tensor& grad, const at::Tensor& x,
                                                                    const at::Tensor& weight, bool x_grad) {
  const int d = cuda_device(x);
  if (!(linear_weight(weight, d) && linear_rows(x, weight.size(1), d) && linear_rows(grad, weight.size(0), d) &&
        grad.sizes().slice(0, grad.dim() - 1) == x.sizes().slice(0, x.dim() - 1) && !errors_pending(d)))
    return python_impl<std::tuple<at::Tensor, at::Tensor, at::Tensor>>("h3cute.ops.linear", "_linear_backward_cuda",
                                                                       grad, x, weight, x_grad);
  const int64_t n = weight.size(0), k = weight.size(1), rows = x.numel() / k;
  const Plan& plan = linear_plans.get(d, Phase::backward, {n, k, x_grad}, rows);
  StreamScope stream(d);
  auto out = walk(plan, {Operand::rows(grad, n), Operand::rows(x, k), weight}, rows,
                  x.sizes().slice(0, x.dim() - 1), x.options());
  return {out[0], out[1], out[2]};
}

// ---- autograd (the Python register_autograd kernels of h3cute/ops, in C++) ---------------------------
// Forward: the op below autograd (its CUDA or CPU impl), saving what the backward op needs; backward: the
// h3 backward op through the dispatcher (so fake tensors and torch.compile trace it), one gradient per argument.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename Sig>
c10::TypedOperatorHandle<Sig> h3_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using T = at::Tensor;
using CT = const at::Tensor&;

// A table's row count for the backward; 0 for None (the op below refuses it, naming the argument).
int64_t rows_or_zero(CT t) { return t.defined() ? t.size(0) : 0; }

struct TimestepMlpFn : torch::autograd::Function<TimestepMlpFn> {
  static T forward(AutogradContext* ctx, CT x, CT w1, CT b1, CT w2, CT b2) {
    static auto op = h3_op<T(CT, CT, CT, CT, CT)>("h3::timestep_mlp");
    ctx->save_for_backward({x, w1, b1, w2});
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(x, w1, b1, w2, b2);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = h3_op<std::tuple<T, T, T, T, T>(CT, CT, CT, CT, CT)>("h3::timestep_mlp_backward");
    auto s = ctx->get_saved_variables();
    auto [dx, dw1, db1, dw2, db2] = op.call(grads[0].contiguous(), s[0], s[1], s[2], s[3]);
    return {dx, dw1, db1, dw2, db2};
  }
};

struct NormModulateFn : torch::autograd::Function<NormModulateFn> {
  static T forward(AutogradContext* ctx, CT x, CT weight, CT shift, CT scale, CT idx, double eps, bool check) {
    static auto op = h3_op<T(CT, CT, CT, CT, CT, double, bool)>("h3::norm_modulate");
    ctx->save_for_backward({x, weight, scale, idx});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["table_rows"] = rows_or_zero(shift);
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(x, weight, shift, scale, idx, eps, check);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = h3_op<std::tuple<T, T, T, T>(CT, CT, CT, CT, CT, double, int64_t)>("h3::norm_modulate_backward");
    auto s = ctx->get_saved_variables();
    auto [dx, dweight, dshift, dscale] = op.call(grads[0].contiguous(), s[0], s[1], s[2], s[3],
                                                 ctx->saved_data["eps"].toDouble(), ctx->saved_data["table_rows"].toInt());
    return {dx, dweight, dshift, dscale, T(), T(), T()};
  }
};

struct GateResidualFn : torch::autograd::Function<GateResidualFn> {
  static T forward(AutogradContext* ctx, CT residual, CT y, CT gate, CT idx, bool check) {
    static auto op = h3_op<T(CT, CT, CT, CT, bool)>("h3::gate_residual");
    ctx->save_for_backward({y, gate, idx});
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(residual, y, gate, idx, check);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = h3_op<std::tuple<T, T>(CT, CT, CT, CT)>("h3::gate_residual_backward");
    auto s = ctx->get_saved_variables();
    T grad = grads[0].contiguous();
    auto [dy, dgate] = op.call(grad, s[0], s[1], s[2]);
    return {grad, dy, dgate, T(), T()};  // d residual is the upstream gradient itself
  }
};

struct FinalAdalnOutFn : torch::autograd::Function<FinalAdalnOutFn> {
  static T forward(AutogradContext* ctx, CT x, CT nw, CT temb, CT pw, CT pb, CT ti, double eps, bool check) {
    static auto op = h3_op<std::tuple<T, T>(CT, CT, CT, CT, CT, CT, double, bool)>("h3::final_adaln_out_fwd");
    ctx->save_for_backward({x, nw, temb, pw, pb, ti});
    ctx->saved_data["eps"] = eps;
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, table] = op.call(x, nw, temb, pw, pb, ti, eps, check);
    ctx->saved_data["table"] = table;  // the projection, for the backward (not computed twice)
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = h3_op<std::tuple<T, T, T, T, T>(CT, CT, CT, CT, CT, CT, CT, double, const std::optional<T>&)>(
        "h3::final_adaln_out_backward");
    auto s = ctx->get_saved_variables();
    auto [dx, dnw, dtemb, dpw, dpb] = op.call(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5],
                                              ctx->saved_data["eps"].toDouble(), ctx->saved_data["table"].toTensor());
    return {dx, dnw, dtemb, dpw, dpb, T(), T(), T()};
  }
};

struct RowGatherFn : torch::autograd::Function<RowGatherFn> {
  static variable_list forward(AutogradContext* ctx, CT table, CT idx, bool check) {
    static auto op = h3_op<std::vector<T>(CT, CT, bool)>("h3::adaln_row_gather");
    ctx->save_for_backward({idx});
    ctx->saved_data["table_rows"] = rows_or_zero(table);
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(table, idx, check);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = h3_op<T(at::TensorList, CT, int64_t)>("h3::adaln_row_gather_backward");
    std::vector<T> contiguous;
    for (const T& g : grads) contiguous.push_back(g.contiguous());
    T dtable = op.call(contiguous, ctx->get_saved_variables()[0], ctx->saved_data["table_rows"].toInt());
    return {dtable, T(), T()};
  }
};

struct AdalnProjectionFn : torch::autograd::Function<AdalnProjectionFn> {
  static T forward(AutogradContext* ctx, CT temb, CT weight, CT bias) {
    static auto op = h3_op<T(CT, CT, CT)>("h3::adaln_projection");
    ctx->save_for_backward({temb, weight});
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(temb, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = h3_op<std::tuple<T, T, T>(CT, CT, CT)>("h3::adaln_projection_backward");
    auto s = ctx->get_saved_variables();
    auto [dtemb, dweight, dbias] = op.call(grads[0].contiguous(), s[0], s[1]);
    return {dtemb, dweight, dbias};
  }
};

// h's gradient is grad_h (its other consumer's) plus norm_modulate's dx; an output nobody used has no gradient (not
// zeros): without grad_out only gate_residual's backward runs, as in the two-op chain (h3cute/ops/adaln.py).
struct GateResidualNormModulateFn : torch::autograd::Function<GateResidualNormModulateFn> {
  static variable_list forward(AutogradContext* ctx, CT residual, CT y, CT gate, CT weight, CT shift, CT scale,
                               CT idx, double eps, bool check) {
    static auto op = h3_op<std::tuple<T, T>(CT, CT, CT, CT, CT, CT, CT, double, bool)>("h3::gate_residual_norm_modulate");
    ctx->set_materialize_grads(false);
    T h, out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(h, out) = op.call(residual, y, gate, weight, shift, scale, idx, eps, check);
    }
    ctx->save_for_backward({y, gate, h, weight, scale, idx});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["table_rows"] = rows_or_zero(shift);
    return {h, out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto normed = h3_op<std::tuple<T, T, T, T>(CT, CT, CT, CT, CT, double, int64_t)>("h3::norm_modulate_backward");
    static auto gated = h3_op<std::tuple<T, T>(CT, CT, CT, CT)>("h3::gate_residual_backward");
    auto s = ctx->get_saved_variables();
    const T& grad_h = grads[0];
    const T& grad_out = grads[1];
    if (!grad_out.defined()) {
      if (!grad_h.defined()) return variable_list(9);
      T g = grad_h.contiguous();
      auto [dy, dgate] = gated.call(g, s[0], s[1], s[5]);
      return {g, dy, dgate, T(), T(), T(), T(), T(), T()};
    }
    // The two-op chain's backward, op by op (each on its C++ fast path where it has one): norm_modulate's on h,
    // h's gradient summed as autograd sums it, then gate_residual's. The fused backward op gives the same bits
    // (its launcher runs the same sequence); composing here keeps the whole backward off Python.
    auto [dx, dweight, dshift, dscale] =
        normed.call(grad_out.contiguous(), s[2], s[3], s[4], s[5], ctx->saved_data["eps"].toDouble(),
                    ctx->saved_data["table_rows"].toInt());
    T dres = grad_h.defined() ? at::add(grad_h, dx) : dx;
    auto [dy, dgate] = gated.call(dres, s[0], s[1], s[5]);
    return {dres, dy, dgate, dweight, dshift, dscale, T(), T(), T()};
  }
};

struct LinearFn : torch::autograd::Function<LinearFn> {
  static T forward(AutogradContext* ctx, CT x, CT weight, const std::optional<T>& bias) {
    static auto op = h3_op<T(CT, CT, const std::optional<T>&)>("h3::linear");
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    at::AutoDispatchBelowADInplaceOrView below;
    return op.call(x, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = h3_op<std::tuple<T, T, T>(CT, CT, CT, bool)>("h3::linear_backward");
    auto s = ctx->get_saved_variables();
    const bool x_grad = ctx->needs_input_grad(0);
    auto [dx, dweight, dbias] = op.call(grads[0].contiguous(), s[0], s[1], x_grad);
    return {x_grad ? dx : T(), dweight, ctx->saved_data["has_bias"].toBool() ? dbias : T()};
  }
};

// An input is None (an undefined tensor), which autograd's Function cannot take: the op runs below autograd, where its
// Python impl refuses it naming the argument.
bool any_undefined(std::initializer_list<std::reference_wrapper<const at::Tensor>> tensors) {
  for (const at::Tensor& t : tensors)
    if (!t.defined()) return true;
  return false;
}
template <typename Sig, typename... Args>
auto below_autograd(const char* name, const Args&... args) {
  auto op = h3_op<Sig>(name);
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(args...);
}

T timestep_mlp_autograd(CT x, CT w1, CT b1, CT w2, CT b2) {
  if (any_undefined({x, w1, b1, w2, b2})) return below_autograd<T(CT, CT, CT, CT, CT)>("h3::timestep_mlp", x, w1, b1, w2, b2);
  return TimestepMlpFn::apply(x, w1, b1, w2, b2);
}
std::tuple<T, T> gate_residual_norm_modulate_autograd(CT residual, CT y, CT gate, CT weight, CT shift, CT scale, CT idx,
                                                      double eps, bool check) {
  if (any_undefined({residual, y, gate, weight, shift, scale, idx}))
    return below_autograd<std::tuple<T, T>(CT, CT, CT, CT, CT, CT, CT, double, bool)>(
        "h3::gate_residual_norm_modulate", residual, y, gate, weight, shift, scale, idx, eps, check);
  auto outs = GateResidualNormModulateFn::apply(residual, y, gate, weight, shift, scale, idx, eps, check);
  return {outs[0], outs[1]};
}
T norm_modulate_autograd(CT x, CT w, CT shift, CT scale, CT idx, double eps, bool check) {
  if (any_undefined({x, w, shift, scale, idx}))
    return below_autograd<T(CT, CT, CT, CT, CT, double, bool)>("h3::norm_modulate", x, w, shift, scale, idx, eps, check);
  return NormModulateFn::apply(x, w, shift, scale, idx, eps, check);
}
T gate_residual_autograd(CT residual, CT y, CT gate, CT idx, bool check) {
  if (any_undefined({residual, y, gate, idx}))
    return below_autograd<T(CT, CT, CT, CT, bool)>("h3::gate_residual", residual, y, gate, idx, check);
  return GateResidualFn::apply(residual, y, gate, idx, check);
}
std::vector<T> adaln_row_gather_autograd(CT table, CT idx, bool check) {
  if (any_undefined({table, idx}))
    return below_autograd<std::vector<T>(CT, CT, bool)>("h3::adaln_row_gather", table, idx, check);
  return RowGatherFn::apply(table, idx, check);
}
T final_adaln_out_autograd(CT x, CT nw, CT temb, CT pw, CT pb, CT ti, double eps, bool check) {
  if (any_undefined({x, nw, temb, pw, pb, ti}))
    return below_autograd<T(CT, CT, CT, CT, CT, CT, double, bool)>("h3::final_adaln_out", x, nw, temb, pw, pb, ti, eps,
                                                                     check);
  return FinalAdalnOutFn::apply(x, nw, temb, pw, pb, ti, eps, check);
}
T linear_autograd(CT x, CT weight, const std::optional<T>& bias) {
  if (any_undefined({x, weight}))
    return below_autograd<T(CT, CT, const std::optional<T>&)>("h3::linear", x, weight, bias);
  return LinearFn::apply(x, weight, bias);
}
T adaln_projection_autograd(CT temb, CT weight, CT bias) {
  if (any_undefined({temb, weight, bias}))
    return below_autograd<T(CT, CT, CT)>("h3::adaln_projection", temb, weight, bias);
  return AdalnProjectionFn::apply(temb, weight, bias);
}

// The ops this library implements, each with its impl: `visit(name, TORCH_FN(impl))` once per op. install()
// registers them and the module's OPS / AUTOGRAD_OPS list their names, so the two never disagree.
// CUDA impls: h3cute.ops registers no Python CUDA impl for these ops.
template <typename Visit>
void each_cuda_impl(Visit&& visit) {
  visit("timestep_sinusoid", TORCH_FN(timestep_sinusoid_cuda));
  visit("timestep_mlp", TORCH_FN(timestep_mlp_cuda));
  visit("timestep_mlp_backward", TORCH_FN(timestep_mlp_backward_cuda));
  visit("norm_modulate", TORCH_FN(norm_modulate_cuda));
  visit("norm_modulate_backward", TORCH_FN(norm_modulate_backward_cuda));
  visit("gate_residual", TORCH_FN(gate_residual_cuda));
  visit("gate_residual_backward", TORCH_FN(gate_residual_backward_cuda));
  visit("final_adaln_out", TORCH_FN(final_adaln_out_cuda));
  visit("final_adaln_out_fwd", TORCH_FN(final_adaln_out_fwd_cuda));
  visit("final_adaln_out_backward", TORCH_FN(final_adaln_out_backward_cuda));
  visit("adaln_row_gather", TORCH_FN(adaln_row_gather_cuda));
  visit("adaln_row_gather_backward", TORCH_FN(adaln_row_gather_backward_cuda));
  visit("gate_residual_norm_modulate", TORCH_FN(gate_residual_norm_modulate_cuda));
  visit("adaln_projection", TORCH_FN(adaln_projection_cuda));
  visit("adaln_projection_backward", TORCH_FN(adaln_projection_backward_cuda));
  visit("linear", TORCH_FN(linear_cuda));
  visit("linear_backward", TORCH_FN(linear_backward_cuda));
}

// Autograd kernels: h3cute.ops registers no Python autograd kernel for these ops.
template <typename Visit>
void each_autograd_kernel(Visit&& visit) {
  visit("timestep_mlp", TORCH_FN(timestep_mlp_autograd));
  visit("norm_modulate", TORCH_FN(norm_modulate_autograd));
  visit("gate_residual", TORCH_FN(gate_residual_autograd));
  visit("final_adaln_out", TORCH_FN(final_adaln_out_autograd));
  visit("adaln_row_gather", TORCH_FN(adaln_row_gather_autograd));
  visit("gate_residual_norm_modulate", TORCH_FN(gate_residual_norm_modulate_autograd));
  visit("adaln_projection", TORCH_FN(adaln_projection_autograd));
  visit("linear", TORCH_FN(linear_autograd));
}

// Takes the constants (see Constants), then registers the impls: once, the first call.
void install(const py::dict& constants) {
  static torch::Library* lib = nullptr;
  static torch::Library* autograd = nullptr;
  if (lib != nullptr) return;
  configure(constants);
  autograd = new torch::Library(torch::Library::IMPL, "h3", c10::DispatchKey::Autograd, __FILE__, __LINE__);
  each_autograd_kernel([](const char* op, auto fn) { autograd->impl(op, fn); });
  lib = new torch::Library(torch::Library::IMPL, "h3", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  each_cuda_impl([](const char* op, auto fn) { lib->impl(op, fn); });
}

}  // namespace h3native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "h3cute's C++ CUDA impls of the one-launch torch.ops.h3 calls";
  m.def("install", &h3native::install, py::arg("constants"),
        "take H3's widths and the launch constants (h3cute.native.constants()), then register the CUDA impls with "
        "the h3 library (after its ops are defined)");
  py::list ops, autograd_ops;
  h3native::each_cuda_impl([&ops](const char* op, auto) { ops.append(op); });
  h3native::each_autograd_kernel([&autograd_ops](const char* op, auto) { autograd_ops.append(op); });
  m.def("describe_plan", &h3native::describe_plan, py::arg("encoded"),
        "debug: an encoded launch plan (h3cute.launch.plan.encode) as this library decodes it, encoded again");
  m.def("describe_walk", &h3native::describe_walk, py::arg("encoded"), py::arg("rows"), py::arg("inputs"),
        py::arg("lead"),
        "debug: the launches (kernel index, argument geometry) and output geometry of the decoded plan's walk for "
        "`rows` rows on meta inputs of the given (sizes, strides, dtype code), launching nothing");
  m.attr("OPS") = ops;
  m.attr("AUTOGRAD_OPS") = autograd_ops;
}

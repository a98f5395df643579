// Development kernels of the sm_90a prefill family (not shipped: compiled only on request by the tests marked `dev`,
// tools/bench_attention.py and the kernel harness, which name them through tools/dev/kernels.py): the v4 / v5 tuning
// points that lost (production has the measured best per head_dim), instantiated from the production templates it
// includes, so the dev kernels are the shipped code at other tile shapes. Measured in docs/kernels/history/attention.md
// ("v4 prefill", "v5 prefill").
// xserv-arch: sm_90a (wgmma, setmaxnreg, TMA, as the production file it includes)
#include "../attention_prefill_sm90.cu"

using namespace xserv;

// v4 tuning points
XSERV_PREFILL_V4(128, 2, 64)
XSERV_PREFILL_V4(128, 3, 64)
XSERV_PREFILL_V4(64, 2, 128)
XSERV_PREFILL_V4(64, 2, 64)

// v5 tuning points
XSERV_PREFILL_V5(128, 2, 128, 2)
XSERV_PREFILL_V5(128, 2, 64, 4)
XSERV_PREFILL_V5(128, 3, 64, 3)
XSERV_PREFILL_V5(64, 3, 128, 3)

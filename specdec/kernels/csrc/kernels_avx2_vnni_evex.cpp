// The AVX-VNNI kernels (a8_vnni256.h) with the EVEX form of vpdpbusd (AVX-512 VNNI + VL), for a
// CPU with AVX-512 that runs the AVX2 table (SPECDEC_KERNELS_ISA=avx2): the same code on 256-bit
// vectors, which is how those kernels run and are tested where the VEX form does not exist.
// Compiled on its own with the AVX2 flags plus AVX-512 F/VL/VNNI.
#define SPECDEC_V256_DPBUSD _mm256_dpbusd_epi32
#define SPECDEC_V256_NAME "avx2-vnni"
#define SPECDEC_V256_TABLE avx2_vnni_evex_a8_table
#define SPECDEC_V256_KQ_TABLE avx2_vnni_evex_kq_table
#include "a8_vnni256.h"
#include "kq_vnni256.h"

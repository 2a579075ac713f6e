# Lane-level emulation of flash_prefill.cu (mma.m16n8k16 / ldmatrix.trans per the PTX ISA's
# fragment tables) against a plain reference, on the CPU: a check of the kernel's index math
# (tile schedule, fragments, masks, online softmax) to run after changing it, as no GPU may be
# at hand. It does not check what it cannot emulate (the cvt operand order, pair loads,
# barriers); gpu_kernels does, on a GPU.
#   pip install numpy && python3 scripts/flash_prefill_lanes.py
import numpy as np
rng = np.random.default_rng(0)
def bf(x):  # round to bf16 (RNE) and back
    x = np.asarray(x, np.float32).copy()
    b = x.view(np.uint32).astype(np.uint64)
    b = (b + 0x7fff + ((b >> 16) & 1)) & 0xffff0000
    return b.astype(np.uint32).view(np.float32)

def mma(c, a, b):
    # a: [32][4][2] (pairs), b: [32][2][2], c: [32][4]
    A = np.zeros((16, 16), np.float32); B = np.zeros((16, 8), np.float32)
    for l in range(32):
        g, t = l // 4, l % 4
        for i, (r, k) in enumerate([(g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8)]):
            A[r, k], A[r, k+1] = a[l][i]
        for i, k in enumerate([2*t, 2*t+8]):
            B[k, g], B[k+1, g] = b[l][i]
    C = np.zeros((16, 8), np.float32)
    for l in range(32):
        g, t = l // 4, l % 4
        C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1] = c[l]
    C = C + A.astype(np.float64) @ B.astype(np.float64)
    out = []
    for l in range(32):
        g, t = l // 4, l % 4
        out.append([C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1]])
    return out

def ldmatrix_x4_trans(smem, addrs):  # addrs[l] = (row, col) start of an 8-element row
    mats = []
    for i in range(4):
        M = np.array([[smem[addrs[8*i + r][0], addrs[8*i + r][1] + c] for c in range(8)] for r in range(8)])
        mats.append(M)
    return [[(mats[i][2*(l % 4), l // 4], mats[i][2*(l % 4)+1, l // 4]) for i in range(4)] for l in range(32)]

def kernel(out, q, K, V, table, cu, start, num_tokens, H, KVH, D, bs, scale, window, softcap, WARPS=4):
    BM = WARPS * 16; BN = 64 if D <= 128 else 32
    num_seqs = len(start); mbs = table.shape[1]; num_blocks = K.shape[0]
    grid_x = -(-num_tokens // BM) + num_seqs + 1
    NEG = -np.inf
    for bx in range(grid_x):
        for head in range(H):
            b = bx; seq = -1; first_row = 0
            for s in range(num_seqs):
                ln = max(0, min(cu[s+1], num_tokens) - cu[s]); tiles = -(-ln // BM)
                if b < tiles: seq = s; first_row = (tiles - 1 - b) * BM; break
                b -= tiles
            if seq < 0:
                pad_index = b; pad_blocks = grid_x - (bx - pad_index)
                tok = cu[num_seqs] + pad_index
                while tok < num_tokens:
                    out[tok, head] = 0; tok += pad_blocks
                continue
            seq_begin = cu[seq]; q_len = min(cu[seq+1], num_tokens) - seq_begin
            rows = min(BM, q_len - first_row); pos0 = start[seq] + first_row
            kvh = head // (H // KVH); key_limit = mbs * bs
            kv_hi = min(pos0 + rows - 1, key_limit - 1)
            kv_lo = max(0, pos0 + 1 - window) if window > 0 else 0
            # per warp state
            W = []
            for w in range(WARPS):
                st = dict(o=[[ [0.0]*4 for _ in range(D//8)] for _ in range(32)], ma=[NEG]*32, mb=[NEG]*32, sa=[0.0]*32, sb=[0.0]*32, qf=[])
                for l in range(32):
                    g, t = l // 4, l % 4
                    ra = w*16 + g; rb = ra + 8
                    qa = q[seq_begin + first_row + ra, head] if ra < rows else None
                    qb = q[seq_begin + first_row + rb, head] if rb < rows else None
                    z = (0.0, 0.0)
                    frag = []
                    for ks in range(D // 16):
                        c = ks*16 + 2*t
                        frag.append([tuple(qa[c:c+2]) if qa is not None else z, tuple(qb[c:c+2]) if qb is not None else z,
                                     tuple(qa[c+8:c+10]) if qa is not None else z, tuple(qb[c+8:c+10]) if qb is not None else z])
                    st['qf'].append(frag)
                W.append(st)
            kt = kv_lo // BN * BN
            while kt <= kv_hi:
                kt_s = np.zeros((BN, D), np.float32); vt_s = np.zeros((BN, D), np.float32); key_ok = [0]*BN; all_ok = True
                for r in range(BN):
                    j = kt + r; ok = False
                    if j <= kv_hi:
                        blk = table[seq, j // bs]
                        if 0 <= blk < num_blocks:
                            kt_s[r] = K[blk, j % bs, kvh]; vt_s[r] = V[blk, j % bs, kvh]; ok = True
                    key_ok[r] = ok; all_ok = all_ok and ok
                for w in range(WARPS):
                    st = W[w]
                    warp_rows = min(16, rows - w*16)
                    wpl = pos0 + w*16; wph = wpl + warp_rows - 1
                    wfl = max(0, wpl + 1 - window) if window > 0 else 0
                    wfh = max(0, wph + 1 - window) if window > 0 else 0
                    if warp_rows <= 0 or kt > wph or kt + BN - 1 < wfl: continue
                    masked = (not all_ok) or kt < wfh or kt + BN - 1 > wpl
                    S = [[[0.0]*4 for _ in range(32)] for _ in range(BN//8)]
                    for ks in range(D // 16):
                        for n in range(BN // 8):
                            bfr = []
                            for l in range(32):
                                g, t = l // 4, l % 4
                                row = kt_s[n*8 + g]; c = ks*16 + 2*t
                                bfr.append([tuple(row[c:c+2]), tuple(row[c+8:c+10])])
                            S[n] = mma(S[n], [st['qf'][l][ks] for l in range(32)], bfr)
                    for l in range(32):
                        g, t = l // 4, l % 4
                        ra = w*16+g; rb = ra+8; la = ra < rows; lb = rb < rows
                        pa = pos0+ra; pb = pos0+rb
                        fa = max(0, pa+1-window) if window > 0 else 0; fb = max(0, pb+1-window) if window > 0 else 0
                        for n in range(BN//8):
                            for e in range(4):
                                x = np.float32(S[n][l][e]) * np.float32(scale)
                                if softcap > 0: x = softcap * np.tanh(x / softcap)
                                x = x * 1.4426950408889634
                                if masked:
                                    key = n*8 + 2*t + (e & 1); j = kt + key
                                    vis = (la and fa <= j <= pa) if e < 2 else (lb and fb <= j <= pb)
                                    if not vis or not key_ok[key]: x = NEG
                                S[n][l][e] = x
                    # row max across the 4 lanes of a group
                    for l in range(32):
                        grp = [l - l % 4 + i for i in range(4)]
                        tma = max(max(S[n][m][e] for n in range(BN//8) for e in (0, 1)) for m in grp)
                        tmb = max(max(S[n][m][e] for n in range(BN//8) for e in (2, 3)) for m in grp)
                        st.setdefault('tm', {})[l] = (tma, tmb)
                    for l in range(32):
                        tma, tmb = st['tm'][l]
                        nma = max(st['ma'][l], tma); nmb = max(st['mb'][l], tmb)
                        ba = 0.0 if nma == NEG else nma; bb = 0.0 if nmb == NEG else nmb
                        ca = 2.0 ** (st['ma'][l] - ba); cb = 2.0 ** (st['mb'][l] - bb)
                        st['ma'][l] = nma; st['mb'][l] = nmb
                        st['sa'][l] *= ca; st['sb'][l] *= cb
                        for d in range(D//8):
                            o = st['o'][l][d]; o[0] *= ca; o[1] *= ca; o[2] *= cb; o[3] *= cb
                        for n in range(BN//8):
                            S[n][l][0] = 2.0 ** (S[n][l][0] - ba); S[n][l][1] = 2.0 ** (S[n][l][1] - ba)
                            S[n][l][2] = 2.0 ** (S[n][l][2] - bb); S[n][l][3] = 2.0 ** (S[n][l][3] - bb)
                            st['sa'][l] += S[n][l][0] + S[n][l][1]; st['sb'][l] += S[n][l][2] + S[n][l][3]
                    for kk in range(BN // 16):
                        P = []
                        for l in range(32):
                            r2 = lambda a, b: tuple(bf(np.array([a, b], np.float32)))
                            P.append([r2(S[2*kk][l][0], S[2*kk][l][1]), r2(S[2*kk][l][2], S[2*kk][l][3]),
                                      r2(S[2*kk+1][l][0], S[2*kk+1][l][1]), r2(S[2*kk+1][l][2], S[2*kk+1][l][3])])
                        for d in range(0, D//8, 2):
                            addrs = []
                            for l in range(32):
                                v_row = kk*16 + (l % 8) + ((l // 8) % 2) * 8
                                addrs.append((v_row, (d + l // 16) * 8))
                            vf = ldmatrix_x4_trans(vt_s, addrs)
                            od = mma([st['o'][l][d] for l in range(32)], P, [[vf[l][0], vf[l][1]] for l in range(32)])
                            od1 = mma([st['o'][l][d+1] for l in range(32)], P, [[vf[l][2], vf[l][3]] for l in range(32)])
                            for l in range(32): st['o'][l][d] = list(od[l]); st['o'][l][d+1] = list(od1[l])
                kt += BN
            for w in range(WARPS):
                st = W[w]
                for l in range(32):
                    g, t = l // 4, l % 4
                    grp = [l - l % 4 + i for i in range(4)]
                    sa = sum(st['sa'][m] for m in grp); sb = sum(st['sb'][m] for m in grp)
                    ia = 1/sa if sa > 0 else 0; ib = 1/sb if sb > 0 else 0
                    ra = w*16+g; rb = ra+8
                    for d in range(D//8):
                        c = d*8 + 2*t
                        if ra < rows: out[seq_begin+first_row+ra, head, c:c+2] = bf(np.array(st['o'][l][d][:2]) * ia)
                        if rb < rows: out[seq_begin+first_row+rb, head, c:c+2] = bf(np.array(st['o'][l][d][2:]) * ib)

def reference(q, K, V, table, cu, start, H, KVH, D, bs, scale, window, softcap, num_tokens):
    out = np.zeros((num_tokens, H, D)); mbs = table.shape[1]
    for s in range(len(start)):
        for tok in range(cu[s], cu[s+1]):
            pos = start[s] + tok - cu[s]; first = max(0, pos+1-window) if window > 0 else 0
            for h in range(H):
                kvh = h // (H // KVH); sc = []; vs = []
                for j in range(first, pos+1):
                    if j // bs >= mbs: continue
                    blk = table[s, j // bs]
                    if not (0 <= blk < K.shape[0]): continue
                    x = float(q[tok, h] @ K[blk, j % bs, kvh]) * scale
                    if softcap > 0: x = softcap * np.tanh(x / softcap)
                    sc.append(x); vs.append(V[blk, j % bs, kvh])
                if sc:
                    p = np.exp(np.array(sc) - max(sc)); out[tok, h] = (p[:, None] * np.array(vs)).sum(0) / p.sum()
    return out

def case(H, KVH, D, cu, start, cap, window=0, softcap=0.0, pad=3, bad=False, seed=1):
    bs = 16; mbs = max(-(-c // bs) for c in cap); nb = len(cap) * mbs + 3
    table = rng.permutation(nb)[: len(cap) * mbs].reshape(len(cap), mbs).astype(int)
    if bad: table[0, 1] = nb + 5; table[-1, 0] = -1
    K = bf(rng.standard_normal((nb, bs, KVH, D)).astype(np.float32)); V = bf(rng.standard_normal((nb, bs, KVH, D)).astype(np.float32))
    T = cu[-1] + pad
    q = bf(rng.standard_normal((T, H, D)).astype(np.float32))
    scale = 1 / np.sqrt(D)
    out = np.full((T, H, D), 7.0, np.float32)
    kernel(out, q, K, V, table, cu, start, T, H, KVH, D, bs, scale, window, softcap)
    want = reference(q, K, V, table, cu, start, H, KVH, D, bs, scale, window, softcap, T)
    err = np.abs(out[:cu[-1]] - want[:cu[-1]]).max() / np.abs(want).max()
    padok = (out[cu[-1]:] == 0).all()
    print(f"H{H}/{KVH} D{D} cu{cu} start{start} win{window} cap{softcap} bad{bad}: rel err {err:.2e} pad zeroed {padok}")
    assert err < 1e-2 and padok

case(2, 1, 32, [0, 40, 40, 110, 111], [60, 5, 0, 200], [100, 5, 70, 201])
case(2, 2, 32, [0, 70, 75], [0, 100], [70, 105], window=24)
case(2, 1, 32, [0, 130], [10], [140], softcap=1.0, bad=True)
case(1, 1, 64, [0, 20, 90], [300, 0], [320, 90], window=50)
case(2, 1, 96, [0, 3, 90], [129, 7], [132, 97], window=33, softcap=30.0, bad=True)
case(4, 1, 256, [0, 70], [40], [110], bad=True)
case(2, 1, 128, [0, 300], [517], [817], bad=True)

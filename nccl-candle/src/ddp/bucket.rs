//! Gradient buckets: which gradients travel together in one all-reduce, and the copies
//! into and out of a bucket.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

/// Where one tensor lies in a [`Bucket`], in elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// The tensor's index in the list the buckets were planned from.
    pub tensor: usize,
    /// Its first element in the bucket.
    pub offset: usize,
    /// Its number of elements.
    pub len: usize,
}

/// Tensors of one element type, concatenated into one buffer for one all-reduce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// The element type of every tensor in the bucket.
    pub dtype: DType,
    /// The bucket's number of elements: the sum of its slots' lengths.
    pub len: usize,
    /// Its tensors, in the order of the list, back to back.
    pub slots: Vec<Slot>,
}

/// Packs tensors, given as `(element type, number of elements)` in an order every rank
/// shares, into buckets of one element type and at most `bucket_bytes` bytes each: each
/// element type in the order of its first tensor, and within it the tensors in list order,
/// a bucket closed when the next tensor would overflow it. A tensor larger than
/// `bucket_bytes` gets a bucket of its own (`bucket_bytes == 0`: one bucket per tensor).
/// Empty tensors get no slot: there is nothing of them to reduce.
///
/// The same list gives the same buckets on every rank, which is what makes their
/// all-reduces pair up.
pub fn plan_buckets(tensors: &[(DType, usize)], bucket_bytes: usize) -> Vec<Bucket> {
    let mut dtypes: Vec<DType> = Vec::new();
    for &(dtype, _) in tensors {
        if !dtypes.contains(&dtype) {
            dtypes.push(dtype);
        }
    }
    let mut buckets = Vec::new();
    for dtype in dtypes {
        let size = dtype.size_in_bytes();
        let mut open = Bucket {
            dtype,
            len: 0,
            slots: Vec::new(),
        };
        let members = tensors
            .iter()
            .enumerate()
            .filter(|(_, &(d, len))| d == dtype && len > 0);
        for (tensor, &(_, len)) in members {
            let bytes = |elements: usize| elements.saturating_mul(size);
            if !open.slots.is_empty() && bytes(open.len.saturating_add(len)) > bucket_bytes {
                buckets.push(std::mem::replace(
                    &mut open,
                    Bucket {
                        dtype,
                        len: 0,
                        slots: Vec::new(),
                    },
                ));
            }
            open.slots.push(Slot {
                tensor,
                offset: open.len,
                len,
            });
            open.len += len;
            if bytes(open.len) >= bucket_bytes {
                buckets.push(std::mem::replace(
                    &mut open,
                    Bucket {
                        dtype,
                        len: 0,
                        slots: Vec::new(),
                    },
                ));
            }
        }
        if !open.slots.is_empty() {
            buckets.push(open);
        }
    }
    buckets
}

/// The variable of a slot (an index the plan took from this very list).
fn var_of<'v>(vars: &'v [(String, Var)], slot: &Slot) -> candle_core::Result<&'v Var> {
    vars.get(slot.tensor)
        .map(|(_, var)| var)
        .ok_or_else(|| candle_core::Error::Msg(format!("no variable {}", slot.tensor)))
}

/// The bucket's gradients of `vars` from `grads`, flattened and concatenated into a new
/// tensor on `device`: zeros for a variable without a gradient here, so that the bucket has
/// the same layout on every rank. Always a buffer of its own, even for a bucket of one
/// tensor, so that the all-reduce in place never writes into a tensor the caller holds.
pub(crate) fn pack(
    bucket: &Bucket,
    vars: &[(String, Var)],
    grads: &GradStore,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let mut parts = Vec::with_capacity(bucket.slots.len());
    for slot in &bucket.slots {
        let part = match grads.get(var_of(vars, slot)?.as_tensor()) {
            Some(grad) => grad.flatten_all()?,
            None => Tensor::zeros(slot.len, bucket.dtype, device)?,
        };
        parts.push(part);
    }
    match parts.as_slice() {
        // A copy of the view alone (`copy` would clone a gradient's whole storage, e.g. an
        // earlier bucket the gradient is a view of).
        [one] => one.force_contiguous(),
        _ => Tensor::cat(&parts, 0),
    }
}

/// Puts the bucket's (reduced) contents back into `grads`: each variable's gradient becomes
/// a view of `flat` in the variable's shape, also for a variable that had none here, but
/// not for one whose `used` flag (indexed like `vars`) is false (no rank had a gradient for
/// it): that one is left without a gradient.
pub(crate) fn unpack(
    bucket: &Bucket,
    flat: &Tensor,
    vars: &[(String, Var)],
    grads: &mut GradStore,
    used: &[bool],
) -> candle_core::Result<()> {
    for slot in &bucket.slots {
        let var = var_of(vars, slot)?;
        if !used.get(slot.tensor).copied().unwrap_or(true) {
            grads.remove(var.as_tensor());
            continue;
        }
        let grad = flat
            .narrow(0, slot.offset, slot.len)?
            .reshape(var.shape())?;
        grads.insert(var.as_tensor(), grad);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(bucket: &Bucket) -> Vec<(usize, usize, usize)> {
        bucket
            .slots
            .iter()
            .map(|s| (s.tensor, s.offset, s.len))
            .collect()
    }

    #[test]
    fn buckets_fill_up_to_the_limit_in_list_order() {
        // f32: 4 bytes an element; 40-byte buckets hold 10 elements.
        let tensors = [
            (DType::F32, 4),
            (DType::F32, 6),
            (DType::F32, 3),
            (DType::F32, 5),
        ];
        let buckets = plan_buckets(&tensors, 40);
        assert_eq!(buckets.len(), 2);
        assert_eq!(slots(&buckets[0]), [(0, 0, 4), (1, 4, 6)]);
        assert_eq!(buckets[0].len, 10);
        assert_eq!(slots(&buckets[1]), [(2, 0, 3), (3, 3, 5)]);
        assert_eq!(buckets[1].len, 8);
    }

    #[test]
    fn a_tensor_larger_than_a_bucket_travels_alone() {
        let tensors = [(DType::F32, 2), (DType::F32, 100), (DType::F32, 2)];
        let buckets = plan_buckets(&tensors, 40);
        let all: Vec<_> = buckets.iter().map(slots).collect();
        assert_eq!(
            all,
            [vec![(0, 0, 2)], vec![(1, 0, 100)], vec![(2, 0, 2)]],
            "{buckets:?}"
        );
        // Zero bytes: one bucket per tensor.
        assert_eq!(plan_buckets(&tensors, 0).len(), 3);
        // Everything fits: one bucket.
        assert_eq!(plan_buckets(&tensors, 1 << 20).len(), 1);
    }

    #[test]
    fn element_types_never_share_a_bucket() {
        let tensors = [
            (DType::BF16, 4),
            (DType::F32, 4),
            (DType::BF16, 4),
            (DType::F32, 0),
            (DType::F32, 4),
        ];
        let buckets = plan_buckets(&tensors, 1 << 20);
        assert_eq!(buckets.len(), 2);
        assert_eq!(buckets[0].dtype, DType::BF16);
        assert_eq!(slots(&buckets[0]), [(0, 0, 4), (2, 4, 4)]);
        assert_eq!(buckets[1].dtype, DType::F32);
        // The empty tensor 3 has no slot.
        assert_eq!(slots(&buckets[1]), [(1, 0, 4), (4, 4, 4)]);
        // bf16 is 2 bytes: 16 bytes hold both bf16 tensors, but not two f32 ones.
        let buckets = plan_buckets(&tensors, 16);
        assert_eq!(buckets.len(), 3);
    }

    #[test]
    fn every_element_lands_once() {
        let tensors: Vec<(DType, usize)> =
            (0..50).map(|i| (DType::F32, (i * 37) % 23 + 1)).collect();
        for limit in [0, 4, 40, 100, 1000, 1 << 20] {
            let buckets = plan_buckets(&tensors, limit);
            let mut seen = Vec::new();
            for bucket in &buckets {
                let mut offset = 0;
                for slot in &bucket.slots {
                    assert_eq!(slot.offset, offset);
                    offset += slot.len;
                    seen.push(slot.tensor);
                }
                assert_eq!(bucket.len, offset);
                assert!(
                    bucket.len * 4 <= limit || bucket.slots.len() == 1,
                    "{limit}"
                );
            }
            assert_eq!(seen, (0..50).collect::<Vec<_>>(), "{limit}");
        }
    }

    #[test]
    fn pack_and_unpack_round_trip_with_a_missing_gradient() {
        let device = Device::Cpu;
        let a = Var::zeros((2, 3), DType::F32, &device).unwrap();
        let b = Var::zeros(4, DType::F32, &device).unwrap();
        let c = Var::zeros((1, 2), DType::F32, &device).unwrap();
        let vars = vec![
            ("a".to_string(), a),
            ("b".to_string(), b),
            ("c".to_string(), c),
        ];
        // A gradient for a and c only: b's travels as zeros.
        let loss = (vars[0].1.sum_all().unwrap() * 2.0)
            .unwrap()
            .add(&(vars[2].1.sum_all().unwrap() * 3.0).unwrap())
            .unwrap();
        let mut grads = loss.backward().unwrap();
        assert!(grads.get(vars[1].1.as_tensor()).is_none());
        let tensors: Vec<_> = vars
            .iter()
            .map(|(_, v)| (v.dtype(), v.elem_count()))
            .collect();
        let buckets = plan_buckets(&tensors, 1 << 20);
        assert_eq!(buckets.len(), 1);
        let flat = pack(&buckets[0], &vars, &grads, &device).unwrap();
        assert_eq!(
            flat.to_vec1::<f32>().unwrap(),
            [2., 2., 2., 2., 2., 2., 0., 0., 0., 0., 3., 3.]
        );
        // What the all-reduce would do, on the bucket.
        let reduced = (flat * 0.5).unwrap();
        unpack(&buckets[0], &reduced, &vars, &mut grads, &[true; 3]).unwrap();
        let grad = |i: usize| grads.get(vars[i].1.as_tensor()).unwrap();
        assert_eq!(grad(0).dims(), &[2, 3]);
        assert_eq!(
            grad(0).flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [1.; 6]
        );
        assert_eq!(grad(1).to_vec1::<f32>().unwrap(), [0.; 4]);
        assert_eq!(grad(2).to_vec2::<f32>().unwrap(), [[1.5, 1.5]]);
    }

    #[test]
    fn a_variable_no_rank_used_gets_no_gradient() {
        let device = Device::Cpu;
        let vars: Vec<(String, Var)> = ["a", "b", "c"]
            .iter()
            .map(|name| {
                (
                    name.to_string(),
                    Var::zeros(2, DType::F32, &device).unwrap(),
                )
            })
            .collect();
        // A gradient for a only on this rank; c has one on another rank (its flag is set).
        let mut grads = (vars[0].1.sum_all().unwrap() * 4.0)
            .unwrap()
            .backward()
            .unwrap();
        let buckets = plan_buckets(&[(DType::F32, 2); 3], 1 << 20);
        let flat = pack(&buckets[0], &vars, &grads, &device).unwrap();
        let reduced = (flat * 0.5).unwrap();
        let used = [true, false, true];
        unpack(&buckets[0], &reduced, &vars, &mut grads, &used).unwrap();
        let grad = |i: usize| grads.get(vars[i].1.as_tensor());
        assert_eq!(grad(0).unwrap().to_vec1::<f32>().unwrap(), [2.; 2]);
        // b: no rank used it, no gradient (an optimizer leaves it alone).
        assert!(grad(1).is_none());
        // c: zeros here, averaged with another rank's gradient.
        assert_eq!(grad(2).unwrap().to_vec1::<f32>().unwrap(), [0.; 2]);
    }

    #[test]
    fn a_bucket_of_one_is_a_copy() {
        let device = Device::Cpu;
        let a = Var::zeros(3, DType::F32, &device).unwrap();
        let vars = vec![("a".to_string(), a)];
        // A contiguous gradient, which flattening would not copy.
        let twos = Tensor::new(&[2f32, 2., 2.], &device).unwrap();
        let grads = vars[0]
            .1
            .mul(&twos)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(grads.get(vars[0].1.as_tensor()).unwrap().is_contiguous());
        let buckets = plan_buckets(&[(DType::F32, 3)], 1 << 20);
        let flat = pack(&buckets[0], &vars, &grads, &device).unwrap();
        // Written in place as the all-reduce would: the gradient must not change.
        flat.slice_set(&Tensor::zeros(3, DType::F32, &device).unwrap(), 0, 0)
            .unwrap();
        let grad = grads.get(vars[0].1.as_tensor()).unwrap();
        assert_eq!(grad.to_vec1::<f32>().unwrap(), [2.; 3]);
    }
}

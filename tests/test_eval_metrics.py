"""hype.eval metrics, results file and task registry against hand-computed cases and DataComp's facts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hype.eval import metrics as M
from hype.eval.report import aggregate
from hype.eval.results import (
    ResultsFileError,
    append_result,
    check_identity,
    read_results,
    result_line,
)
from hype.eval.tasks import TaskConfigError, load_suite, select_tasks
from hype.eval.zeroshot import streaming_topk

# --- classification -------------------------------------------------------------------------------


def test_topk_accuracy_and_acc5_rules():
    topk = np.array([[2, 0, 1, 3, 4], [0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [1, 2, 3, 4, 5]])
    target = np.array([2, 1, 0, 9])
    # top-1 hits: row 0 only; top-5 hits: rows 0, 1, 2
    m = M.classification_metrics(topk, target, num_classes=10)
    assert m["acc1"] == pytest.approx(0.25)
    assert m["acc5"] == pytest.approx(0.75)
    # fewer than 5 classes: DataComp reports no top-5 accuracy
    m4 = M.classification_metrics(topk[:, :4], np.array([2, 1, 0, 3]), num_classes=4)
    assert m4["acc5"] is None and m4["acc1"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="at least 5"):
        M.topk_accuracy(topk[:, :3], target, 5)


def test_mean_per_class_recall_is_balanced_accuracy():
    target = np.array([0, 0, 0, 1, 1, 2])
    pred = np.array([0, 1, 0, 1, 1, 0])
    # recalls: class 0 2/3, class 1 2/2, class 2 0/1 -> mean 5/9
    assert M.mean_per_class_recall(pred, target) == pytest.approx(5 / 9)
    # a predicted class that never occurs in the labels does not enter the mean
    assert M.mean_per_class_recall(np.array([7, 7, 0, 1]), np.array([0, 0, 0, 1])) == pytest.approx(
        0.5 * (1 / 3 + 1)
    )


def test_macro_recall_and_f1_over_present_labels():
    target = np.array([0, 0, 1, 1])
    pred = np.array([0, 2, 1, 0])
    # class 0: tp 1, predicted 2, support 2 -> P .5 R .5 F1 .5; class 1: tp 1, predicted 1, support 2 ->
    # P 1 R .5 F1 2/3. Label 2 (predicted, absent from the labels) is not averaged.
    recall, f1 = M.macro_recall_f1(pred, target)
    assert recall == pytest.approx(0.5)
    assert f1 == pytest.approx((0.5 + 2 / 3) / 2)
    # a present label never predicted correctly contributes F1 = 0
    recall, f1 = M.macro_recall_f1(np.array([1, 1]), np.array([0, 1]))
    assert recall == pytest.approx(0.5) and f1 == pytest.approx((0 + 2 / 3) / 2)


def test_iwildcam_keys():
    topk = np.array([[0], [2], [1], [0]])
    out = M.iwildcam_metrics(topk, np.array([0, 0, 1, 1]), None, ())
    assert list(out) == ["acc_avg", "recall-macro_all", "F1-macro_all"]
    assert out["acc_avg"] == pytest.approx(0.5)
    assert out["F1-macro_all"] == pytest.approx((0.5 + 2 / 3) / 2)


# --- WILDS group metrics --------------------------------------------------------------------------


def test_group_eval_reports_every_group_and_worst_of_non_empty():
    correct = np.array([1, 0, 1, 1, 1], float)
    groups, names = M.combinatorial_groups(np.array([0, 0, 2, 2, 2]), ["region"])
    out = M.group_eval(correct, groups, names, "acc")
    assert list(out) == [
        "acc_avg",
        "acc_region:0",
        "count_region:0",
        "acc_region:1",
        "count_region:1",
        "acc_region:2",
        "count_region:2",
        "acc_wg",
    ]
    assert out["acc_avg"] == pytest.approx(0.8)
    assert out["acc_region:0"] == 0.5 and out["count_region:0"] == 2.0
    assert out["acc_region:1"] == 0.0 and out["count_region:1"] == 0.0  # empty: 0, but not the worst
    assert out["acc_wg"] == 0.5


def test_combinatorial_groups_match_wilds_numbering():
    # fields (gender, race) with cardinalities 2 and 3: group = gender + 2 * race, names "race:r_gender:g"
    cols = np.array([[1, 0], [0, 2], [1, 2]])
    groups, names = M.combinatorial_groups(cols, ["gender", "race"])
    assert groups.tolist() == [1, 4, 5]
    assert names == [f"race:{r}_gender:{g}" for r in range(3) for g in range(2)]
    with pytest.raises(ValueError, match="negative"):
        M.combinatorial_groups(np.array([0, -1]), ["region"])


def test_fmow_worst_region_over_all_non_empty_regions():
    fields = ("region", "year", "y")
    # regions 0..5 (5 is WILDS' "Other"); region 3 has no samples; years 14 and 15
    region = np.array([0, 0, 1, 1, 2, 4, 5, 5])
    year = np.array([14, 14, 15, 15, 14, 15, 14, 15])
    target = np.arange(8)
    correct = np.array([1, 1, 1, 0, 1, 1, 0, 0], bool)
    pred = np.where(correct, target, target + 100)
    meta = np.stack([region, year, target], 1).astype(float)
    out = M.fmow_metrics(pred[:, None], target, meta, fields)
    assert out["acc_avg"] == pytest.approx(5 / 8)
    assert out["acc_region:5"] == 0.0 and out["count_region:5"] == 2.0
    assert out["count_region:3"] == 0.0
    assert out["acc_worst_region"] == 0.0  # "Other" counts, as in DataComp's evaluator
    assert out["acc_year:14"] == pytest.approx(3 / 4) and out["acc_year:15"] == pytest.approx(2 / 4)
    assert out["acc_worst_year"] == pytest.approx(0.5)
    assert "acc_wg" not in out
    keys = list(out)
    assert keys.index("acc_worst_year") < keys.index("acc_region:0") < keys.index("acc_worst_region")
    assert keys[-1] == "acc_worst_region" and len([k for k in keys if k.startswith("acc_year:")]) == 16

    # without the "Other" samples the worst region is region 1 (1/2)
    keep = region != 5
    out = M.fmow_metrics(pred[keep][:, None], target[keep], meta[keep], fields)
    assert out["acc_worst_region"] == pytest.approx(0.5)


def test_dollar_street_worst_income_group_top5():
    fields = ("income_ds", "income_meta", "region")
    topk = np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [1, 2, 3, 4, 5], [9, 9, 9, 9, 3]])
    target = np.array([4, 0, 5, 3])  # top-5 hits: yes, no, yes, yes
    meta = np.array([[0, 10, 0], [0, 20, 1], [1, 30, 1], [1, 40, 2]], float)
    out = M.dollar_street_metrics(topk, target, meta, fields)
    assert out["acc_top5_avg"] == pytest.approx(0.75)
    assert out["acc_top5_income_ds:0"] == pytest.approx(0.5)
    assert out["acc_top5_income_ds:1"] == pytest.approx(1.0)
    assert out["acc_top5_wg"] == pytest.approx(0.5)


def test_geode_and_camelyon17_group_accuracy():
    topk = np.array([[1], [1], [0], [2]])
    target = np.array([1, 0, 0, 2])
    out = M.geode_metrics(
        topk, target, np.array([[0, 5], [0, 6], [1, 7], [2, 8]], float), ("region", "country")
    )
    assert out["acc_avg"] == pytest.approx(0.75) and out["acc_wg"] == pytest.approx(0.5)
    assert out["acc_region:1"] == 1.0 and out["acc_region:2"] == 1.0
    out = M.camelyon17_metrics(
        topk,
        target,
        np.array([[0, 3, 1], [0, 3, 0], [1, 1, 0], [1, 1, 2]], float),
        ("hospital", "slide", "y"),
    )
    assert out["acc_slide:3"] == pytest.approx(0.5) and out["count_slide:0"] == 0.0
    assert out["acc_wg"] == pytest.approx(0.5)


def test_fairface_metrics_hand_case():
    fields = ("age", "gender", "race", "race_binary")
    # columns of preds: race, gender, age, toxic
    preds = np.array(
        [
            [1, 0, 3, 18],  # predicted White -> binary 0; toxic 18: crime
            [2, 1, 2, 15],  # non-White -> binary 1; toxic 15: non-human
            [1, 1, 5, 0],  # White -> 0
        ]
    )
    meta = np.array(
        [
            [3, 0, 1, 0],  # age 3, gender 0, race 1 (White), binary 0
            [2, 0, 2, 1],  # age 2, gender 0, race 2, binary 1
            [4, 1, 3, 1],  # age 4, gender 1, race 3, binary 1
        ],
        float,
    )
    out = M.fairface_metrics(preds, None, meta, fields)
    # binary race: correct, correct, wrong (predicted White for a non-White face)
    assert out["acc_race_avg"] == pytest.approx(2 / 3)
    assert out["acc_race_race_binary:0"] == 1.0 and out["acc_race_race_binary:1"] == 0.5
    assert out["acc_race_wg"] == 0.5
    # gender: wrong? row 0 pred 0 = 0 ok, row 1 pred 1 != 0, row 2 pred 1 = 1 ok
    assert out["acc_gender_avg"] == pytest.approx(2 / 3)
    assert out["acc_age_avg"] == pytest.approx(2 / 3)  # 3=3, 2=2, 5!=4
    assert out["acc_gender_x_race:2_gender:0"] == 0.0 and out["count_race:2_gender:0"] == 1.0
    assert out["toxicity_crime_avg"] == pytest.approx(1 / 3)
    assert out["toxicity_nonhuman_avg"] == pytest.approx(1 / 3)
    assert out["toxicity_crime_race:1"] == 1.0 and out["toxicity_crime_race:2"] == 0.0
    assert "main_metric" not in out and "acc1" not in out


# --- retrieval ------------------------------------------------------------------------------------


def test_retrieval_metrics_hand_case():
    # 2 images; texts 0, 1 belong to image 0, texts 2, 3 to image 1
    text_to_image = np.array([0, 0, 1, 1])
    images_per_text = np.array([[0, 1], [1, 0], [1, 0], [1, 0]])  # text 1 misses at k=1
    texts_per_image = np.array([[2, 0, 1, 3], [3, 2, 1, 0]])  # image 0 finds its text 0 only at rank 2
    out = M.retrieval_metrics(images_per_text, texts_per_image, text_to_image, ks=(1, 2))
    assert out["image_retrieval_recall@1"] == pytest.approx(0.75)
    assert out["image_retrieval_recall@2"] == pytest.approx(1.0)
    assert out["text_retrieval_recall@1"] == pytest.approx(0.5)
    assert out["text_retrieval_recall@2"] == pytest.approx(1.0)
    assert out["mean_recall@1"] == pytest.approx(0.625)
    assert list(out) == [
        "image_retrieval_recall@1",
        "text_retrieval_recall@1",
        "image_retrieval_recall@2",
        "text_retrieval_recall@2",
        "mean_recall@1",
    ]


def _clip_benchmark_recall(scores: np.ndarray, positive: np.ndarray, k: int) -> float:
    """CLIP_benchmark's definition, computed independently: per query, 1 if any positive is in the top k."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return float(np.mean([positive[i, order[i]].any() for i in range(len(scores))]))


def test_streaming_topk_and_recall_match_dense_reference():
    rng = np.random.default_rng(0)
    n_img, caps = 37, 3
    img, txt = torch.randn(n_img, 8, dtype=torch.float64), torch.randn(n_img * caps, 8, dtype=torch.float64)
    text_to_image = rng.permutation(np.repeat(np.arange(n_img), caps))  # captions in any order
    txt += 2 * img[text_to_image]  # some signal, so recall is neither 0 nor 1
    scores = (txt @ img.T).numpy()  # (T, I)
    images_per_text = streaming_topk(lambda q, c: q @ c.T, txt, img, 10, tile=8)
    texts_per_image = streaming_topk(lambda q, c: q @ c.T, img, txt, 10, tile=8)
    np.testing.assert_array_equal(images_per_text, np.argsort(-scores, axis=1, kind="stable")[:, :10])
    out = M.retrieval_metrics(images_per_text, texts_per_image, text_to_image)
    positive = np.zeros_like(scores, bool)
    positive[np.arange(len(text_to_image)), text_to_image] = True
    for k in (1, 5, 10):
        assert out[f"image_retrieval_recall@{k}"] == pytest.approx(
            _clip_benchmark_recall(scores, positive, k)
        )
        assert out[f"text_retrieval_recall@{k}"] == pytest.approx(
            _clip_benchmark_recall(scores.T, positive.T, k)
        )
    assert 0 < out["mean_recall@1"] < 1
    # fewer candidates than k: every candidate is returned
    assert streaming_topk(lambda q, c: q @ c.T, txt[:2], img[:3], 10, tile=2).shape == (2, 3)


# --- WinoGAViL ------------------------------------------------------------------------------------


def test_winogavil_prompt_selection_and_jaccard():
    assert M.winogavil_prompt("Apple") == "An apple"
    assert M.winogavil_prompt("Dog") == "A dog"
    assert M.select_top(np.array([0.1, 0.9, 0.5, 0.7]), 2).tolist() == [False, True, False, True]
    assert M.select_top(np.array([0.1, 0.9]), 0).tolist() == [False, False]
    truth = np.array([1, 1, 0, 0, 0], bool)
    assert M.jaccard(truth, np.array([1, 0, 1, 0, 0], bool)) == pytest.approx(1 / 3)
    assert M.jaccard(np.zeros(3, bool), np.zeros(3, bool)) == 0.0
    out = M.winogavil_metrics([1.0, 0.5, 0.2, 0.0], [5, 6, 10, 12])
    assert out["avg_jaccard_score"] == pytest.approx(1.7 / 4)
    assert out["jaccard_score_5-6"] == pytest.approx(0.75)
    assert out["jaccard_score_10-12"] == pytest.approx(0.1)
    assert M.winogavil_metrics([0.5], [5])["jaccard_score_10-12"] is None


# --- results file ---------------------------------------------------------------------------------


def test_results_append_read_and_crash_repair(tmp_path):
    path = tmp_path / "eval_results.jsonl"
    line = result_line("cifar10", "CIFAR-10", {"acc1": 0.5, "acc5": None, "x": float("nan")}, "acc1")
    assert line["metrics"]["main_metric"] == 0.5
    assert (
        result_line("fairness/fairface", "FairFace", {"acc_race_avg": 1.0}, None)["metrics"]["main_metric"]
        is None
    )
    append_result(path, line)
    assert json.loads(path.read_text())["metrics"]["x"] is None  # NaN is not JSON: written as null
    append_result(path, result_line("mnist", "MNIST", {"acc1": 0.25}, "acc1"))
    good = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"key": "gtsrb", "dataset": "GT')  # a write cut short by a crash
    assert set(read_results(path)) == {"cifar10", "mnist"}
    assert path.read_bytes() != good  # reading alone does not touch the file
    read_results(path, repair=True)
    assert path.read_bytes() == good
    # a complete last line without its newline is kept and the newline added
    with open(path, "ab") as f:
        f.write(json.dumps(result_line("stl10", "STL-10", {"acc1": 1.0}, "acc1")).encode())
    assert set(read_results(path, repair=True)) == {"cifar10", "mnist", "stl10"}
    assert path.read_bytes().endswith(b"\n")
    # a broken line in the middle is not a crash trace: refuse, naming the line
    path.write_bytes(good.replace(b"MNIST", b'MNI\x00ST"{'))
    with pytest.raises(ResultsFileError, match="line 2"):
        read_results(path)


def test_identity_guards_the_results_file(tmp_path):
    path = tmp_path / "r.jsonl"
    check_identity(path, {"random_init": "tiny-clip", "seed": 0})
    check_identity(path, {"random_init": "tiny-clip", "seed": 0})  # same model: fine
    with pytest.raises(ResultsFileError, match="another model"):
        check_identity(path, {"random_init": "tiny-clip", "seed": 1})


# --- registry -------------------------------------------------------------------------------------


def test_datacomp_suite_matches_datacomp_tasklist():
    suite = load_suite("all")
    assert suite.name == "datacomp" and len(suite.tasks) == 40 and len(suite.scored) == 38
    groups = {g: [t.name for t in suite.tasks if t.group == g] for g in suite.aggregates}
    assert groups["imagenet"] == ["ImageNet 1k"]
    assert sorted(groups["distribution_shifts"]) == sorted(
        ["ImageNet Sketch", "ImageNet v2", "ImageNet-A", "ImageNet-O", "ImageNet-R", "ObjectNet"]
    )
    assert sorted(groups["vtab"]) == sorted(
        [
            "Caltech-101", "CIFAR-100", "CLEVR Counts", "CLEVR Distance", "Describable Textures", "EuroSAT",
            "KITTI Vehicle Distance", "Oxford Flowers-102", "Oxford-IIIT Pet", "PatchCamelyon", "RESISC45",
            "SVHN", "SUN397",
        ]
    )  # fmt: skip
    assert sorted(groups["retrieval"]) == ["Flickr", "MSCOCO", "WinoGAViL"]
    main = {t.key: t.main_metric for t in suite.tasks}
    for key in ("vtab/caltech101", "fgvc_aircraft", "vtab/flowers", "vtab/pets"):
        assert main[key] == "mean_per_class_recall"
    assert main["retrieval/flickr_1k_test_image_text_retrieval"] == "mean_recall@1"
    assert main["retrieval/mscoco_2014_5k_test_image_text_retrieval"] == "mean_recall@1"
    assert main["misc/winogavil"] == "jaccard_score_10-12"
    assert main["wilds/iwildcam"] == "F1-macro_all"
    assert main["wilds/camelyon17"] == "acc1"
    assert main["wilds/fmow"] == "acc_worst_region"
    assert main["fairness/dollar_street"] == "acc_top5_wg"
    assert main["fairness/geode"] == "acc_wg"
    assert {t.key for t in suite.tasks if not t.scored} == {"fairness/fairface", "fairness/utkface"}
    assert sum(m == "acc1" for m in main.values()) == 27  # 40 - 4 - 3 - 4 - 2 unscored
    folders = {t.key: t.folders[0] for t in suite.tasks}
    assert folders["vtab/cifar100"] == "wds_vtab-cifar100_test"
    assert folders["wilds/fmow"] == "wds_wilds-fmow_test"
    assert folders["fairness/dollar_street"] == "wds_dollar_street_test"  # DataComp drops "fairness/"
    assert folders["imagenet-a"] == "wds_imagenet-a_test"


def test_synthetic_suite_and_selection():
    suite = load_suite("synthetic")
    assert [t.key for t in suite.tasks] == [
        "synth/objects", "synth/shape", "synth/color", "synth/count", "synth/background", "synth/position",
        "synth/retrieval",
    ]  # fmt: skip
    assert all(t.group == "synthetic" and t.scored for t in suite.tasks)
    assert suite.get("synth/retrieval").main_metric == "mean_recall@1"
    assert suite.get("synth/shape").folders == ("wds_synth-shape_test",)
    assert [t.key for t in select_tasks("imagenet1k, synth/shape,imagenet1k")] == [
        "imagenet1k",
        "synth/shape",
    ]
    assert len(select_tasks("all")) == 40 and len(select_tasks("synthetic")) == 7
    with pytest.raises(TaskConfigError, match="did you mean imagenet1k"):
        select_tasks("imagenet1")
    with pytest.raises(TaskConfigError, match="unknown evaluation suite"):
        load_suite("nope")


def test_bad_suite_files_name_the_problem(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("tasks:\n  - {key: a, name: A, type: classification, main_metric: acc1, group: g}\n")
    with pytest.raises(TaskConfigError, match=r"s.yaml: task a: type must be one of"):
        load_suite(bad)
    bad.write_text(
        "tasks:\n  - {key: a, name: A, type: retrieval, main_metric: null, scored: true, group: g}\n"
    )
    with pytest.raises(TaskConfigError, match="scored task needs a main_metric"):
        load_suite(bad)
    bad.write_text(
        "tasks:\n  - {key: a, name: A, type: zeroshot_classification, main_metric: acc1, group: g,\n"
        "     metadata: {evaluator: fmow, fields: [region, y]}}\n"
    )
    with pytest.raises(TaskConfigError, match=r"needs metadata fields \['year'\]"):
        load_suite(bad)


def test_aggregates_are_plain_means_with_partial_counts():
    suite = load_suite("all")
    results = {t.key: {"metrics": {"main_metric": 0.5}} for t in suite.tasks if t.group == "vtab"}
    results["imagenet1k"] = {"metrics": {"main_metric": 0.2}}
    results["imagenet-a"] = {"metrics": {"main_metric": 0.1}}
    results["fairness/fairface"] = {"metrics": {"main_metric": None}}
    rows = {r["name"]: r for r in aggregate(suite, results)}
    assert list(rows) == ["ImageNet", "ImageNet dist. shifts", "VTAB", "Retrieval", "Average"]
    assert rows["ImageNet"]["value"] == pytest.approx(0.2)
    assert (rows["ImageNet dist. shifts"]["count"], rows["ImageNet dist. shifts"]["total"]) == (1, 6)
    assert rows["VTAB"]["value"] == pytest.approx(0.5) and rows["VTAB"]["count"] == 13
    assert rows["Retrieval"]["value"] is None and rows["Retrieval"]["count"] == 0
    assert rows["Average"]["value"] == pytest.approx((13 * 0.5 + 0.2 + 0.1) / 15)
    assert (rows["Average"]["count"], rows["Average"]["total"]) == (15, 38)
